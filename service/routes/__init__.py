"""Thin HTTP front ends: parse, call the registry, encode. No numpy math, no onnxruntime."""
