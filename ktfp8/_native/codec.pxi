# FP8 codec seam: see fp8_codec.h (filled in with the codec).
