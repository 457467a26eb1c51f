"""Inference: the KV-cache sampler, slot decoding of the serving loop, quantised weights."""
