"""Thin HTTP front ends: parse, call the plane, encode. No numpy math, no onnxruntime."""
