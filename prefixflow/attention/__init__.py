"""The SDPA boundary: the wrapper every attention layer gets and the attention modes of the phases."""
