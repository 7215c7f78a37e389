"""jaxspec: EAGLE-3 speculative decoding for Kimi-K2.5 in JAX."""
