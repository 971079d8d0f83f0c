/* Router logits -> (topk_ids, topk_weights), as ktfp8.route documents it (routing.c, baseline
 * flags).  float32 arithmetic throughout, like the Hugging Face routers. */
#ifndef KTFP8_ROUTING_H
#define KTFP8_ROUTING_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum ktfp8_scoring { KTFP8_SOFTMAX = 0, KTFP8_SIGMOID = 1 };
/* A group's score: its best (biased) score, DeepSeek-V2's group_limited_greedy, or the sum of its two
 * best, DeepSeek-V3's noaux_tc (with sigmoid scores) and Mistral 4's (with softmax scores). */
enum ktfp8_group_score { KTFP8_GROUP_BEST = 0, KTFP8_GROUP_TOP2_SUM = 1 };

typedef struct ktfp8_route_cfg {
    int64_t experts, top_k;
    int32_t scoring;               /* enum ktfp8_scoring */
    int64_t n_group, topk_group;   /* n_group divides experts; topk_group <= n_group */
    int32_t group_score;           /* enum ktfp8_group_score */
    int32_t norm_topk_prob;        /* 1: weights divided by their sum (+1e-20) */
    float routed_scaling_factor;
} ktfp8_route_cfg;

/* logits [tokens, experts], bias NULL or [experts] (finite), ids and weights [tokens, top_k]; all
 * C-contiguous.  Returns 0, or -1 when scratch memory cannot be had (nothing written then). */
int ktfp8_route(const ktfp8_route_cfg *cfg, const float *logits, int64_t tokens, const float *bias,
                int64_t *ids, float *weights);

#ifdef __cplusplus
}
#endif
#endif
