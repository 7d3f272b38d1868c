import torch

# One spec per operator family and option that changes the encoding.
OP_SPECS = [
    "identity", "fp16", "bf16",
    "int8", "int8:per=tensor", "int8:per=channel", "int4:per=block64", "int4:asym", "int2", "int2:asym:stoch",
    "int1", "int1:stoch", "int8:scale=fp16", "int4:per=block32:scale=fp32",
    "fp8", "fp8:e5m2", "fp8:per=row", "fp8:per=block128:scale=bf16",
    "topk:0.1", "topk:0.3:per=row", "topk:0.05:per=tensor", "topk:0.5:index=bitmap", "topk:0.01:index=index",
    "randk:0.1", "randk:0.2:unbiased:per=row",
    "lowrank:4", "lowrank:4:method=svd:iters=2",
    "topk:0.1>int8", "topk:0.2>bf16", "lowrank:2>int8",
]
FEEDBACK_SPECS = ["topk:0.1+ef", "int4+ef", "randk:0.2+ef21", "topk:0.1>int8+ef21", "int8+aqsgd", "topk:0.3+aqsgd"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
