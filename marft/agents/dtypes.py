"""The parameter dtypes ``--dtype`` accepts: one table, read by the config's validation and ``--help``,
the model loader and the benchmark."""

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
