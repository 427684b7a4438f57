"""``--dtype`` (:data:`marft.choices.DTYPES`) → the torch dtype, read by the model loader and the benchmark."""

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
