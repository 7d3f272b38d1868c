import torch

from pp_compress.ops import example_specs

# Every registered operator's own EXAMPLES (see OpConfig.EXAMPLES), plus compositions (not operators themselves).
CHAIN_SPECS = ["topk:0.1>int8", "topk:0.2>bf16", "lowrank:2>int8", "topk:0.1>int3", "mdtopk:0.2>int8",
               "mdtopk:0.3:mode=weighted_greedy>int4"]
OP_SPECS = example_specs() + CHAIN_SPECS
FEEDBACK_SPECS = ["topk:0.1+ef", "int4+ef", "randk:0.2+ef21", "topk:0.1>int8+ef21", "int8+aqsgd", "topk:0.3+aqsgd",
                  "int3:rot+ef", "int4:rot:stoch+ef21", "int1+ef", "nat:bits=4+ef21", "mdtopk:0.2+ef",
                  "mdtopk:0.2:mode=stochastic>int8+ef21"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
