"""Low-bit weights on CPU through torch's own int4 / int8 kernels.

groups (quantized matrices as codes, scales, offsets) -> gguf_groups (a GGUF file's
blocks as groups, unchanged) and quantize (float weights as groups) -> layouts (packed
for the kernels) -> linear (the module a projection becomes) -> apply (swapping a
model's projections); methods names the ``quantization=`` values.
"""
