/* Routing: scores, optional group limit, top-k, weights.  The rules (ties, NaN) are ktfp8.route's:
 * among equal values the lower index wins, NaN ranks below everything, and a row with a NaN score
 * gets NaN weights (its ids stay valid, distinct experts). */
#include "ktfp8/routing.h"

#include "ktfp8/fpenv.h"

#include <math.h>
#include <stdlib.h>

/* 1 when value a at index ia ranks before value b at ib: larger first, then lower index, NaN last. */
static int ranks_before(float a, int64_t ia, float b, int64_t ib) {
    if (isnan(a)) return isnan(b) && ia < ib;
    if (isnan(b) || a > b) return 1;
    return a == b && ia < ib;
}

/* best[0..k) = indices of the k best of v[0..n), best first (insertion into a sorted run). */
static void top_k(const float *v, int64_t n, int64_t k, int64_t *best) {
    int64_t have = 0;
    for (int64_t i = 0; i < n; i++) {
        if (have == k && !ranks_before(v[i], i, v[best[k - 1]], best[k - 1])) continue;
        int64_t at = have < k ? have++ : k - 1;
        for (; at > 0 && ranks_before(v[i], i, v[best[at - 1]], best[at - 1]); at--) best[at] = best[at - 1];
        best[at] = i;
    }
}

/* Scores of one row; returns 1 when one is NaN. */
static int score_row(const ktfp8_route_cfg *cfg, const float *logit, float *score) {
    const int64_t E = cfg->experts;
    int nan = 0;
    if (cfg->scoring == KTFP8_SIGMOID) {
        for (int64_t e = 0; e < E; e++) score[e] = 1.0f / (1.0f + expf(-logit[e]));
    } else {
        float max = logit[0];
        for (int64_t e = 1; e < E; e++)
            if (!isnan(max) && (isnan(logit[e]) || logit[e] > max)) max = logit[e]; /* NaN propagates */
        float sum = 0.0f;
        for (int64_t e = 0; e < E; e++) sum += score[e] = expf(logit[e] - max); /* +-Inf, NaN: NaN */
        for (int64_t e = 0; e < E; e++) score[e] /= sum;
    }
    for (int64_t e = 0; e < E; e++) nan |= isnan(score[e]);
    return nan;
}

/* choice[e] = -inf for every expert outside the topk_group best groups.  A group's score is its
 * best score or the sum of its two best (cfg->group_score; a group of one: its score); a NaN in the
 * group makes the group's score NaN. */
static void keep_best_groups(const ktfp8_route_cfg *cfg, float *choice, float *group_score, int64_t *best) {
    const int64_t G = cfg->n_group, per = cfg->experts / G;
    for (int64_t g = 0; g < G; g++) {
        const float *c = choice + g * per;
        float first = -INFINITY, second = -INFINITY, nan = 0.0f;
        for (int64_t i = 0; i < per; i++) {
            if (isnan(c[i])) nan = c[i];
            else if (c[i] > first) second = first, first = c[i];
            else if (c[i] > second) second = c[i];
        }
        float s = cfg->group_score == KTFP8_GROUP_TOP2_SUM && per > 1 ? first + second : first;
        group_score[g] = isnan(nan) ? nan : s;
    }
    top_k(group_score, G, cfg->topk_group, best);
    for (int64_t g = 0; g < G; g++) {
        int kept = 0;
        for (int64_t j = 0; j < cfg->topk_group; j++) kept |= best[j] == g;
        if (!kept)
            for (int64_t i = 0; i < per; i++) choice[g * per + i] = -INFINITY;
    }
}

int ktfp8_route(const ktfp8_route_cfg *cfg, const float *logits, int64_t tokens, const float *bias,
                int64_t *ids, float *weights) {
    const int64_t E = cfg->experts, k = cfg->top_k, G = cfg->n_group;
    float *score = malloc(sizeof(float) * (size_t)(2 * E + G));
    int64_t *best = malloc(sizeof(int64_t) * (size_t)(G > k ? G : k));
    if (!score || !best) {
        free(score);
        free(best);
        return -1;
    }
    float *choice = score + E, *group_score = choice + E;
    const unsigned csr = ktfp8_fpenv_ieee(); /* subnormal weights stay (a far-behind softmax logit) */
    for (int64_t t = 0; t < tokens; t++) {
        const int nan = score_row(cfg, logits + t * E, score);
        for (int64_t e = 0; e < E; e++) choice[e] = bias ? score[e] + bias[e] : score[e];
        if (G > 1) keep_best_groups(cfg, choice, group_score, best);
        int64_t *row_ids = ids + t * k;
        float *w = weights + t * k;
        top_k(choice, E, k, row_ids);
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) sum += w[j] = score[row_ids[j]];
        for (int64_t j = 0; j < k; j++) {
            /* DeepSeek adds 1e-20 to the denominator; for softmax top-k the sum is >= 1/experts,
             * where in float32 it changes nothing, so one formula serves every family */
            if (cfg->norm_topk_prob) w[j] /= sum + 1e-20f;
            w[j] = nan ? NAN : w[j] * cfg->routed_scaling_factor;
        }
    }
    ktfp8_fpenv_restore(csr);
    free(score);
    free(best);
    return 0;
}
