"""Evidence runs for a GPU machine, outside the product (nothing in trainer/ imports this package).

- ``cases``: the training cases, in groups named by what they measure.
- ``training``: ``python -m trainer.bench``, each case a real ``python -m trainer.run`` job.
- ``decode``: ``python -m trainer.bench --gpu-decode-only``, bytes to pixel rows / pixel_values on
  DALI GPU, DALI CPU and torchvision nvJPEG.
- ``plots``: ``python -m trainer.bench.plots``, figures and tables from the results.
- ``gpu_proof``: ``python -m trainer.bench.gpu_proof``, packed row == samples alone, and the
  Megatron-Bridge loop on synthetic rows.
- ``vision_graphs``: ``python -m trainer.bench.vision_graphs``, the vision tower's fixed-length
  (CUDA-graph) path against its THD path: outputs and cost.
- ``peers``: ``vlmfeed bench peers``, side by side with the paths a user would assemble instead.
"""


def trainer_defaults() -> dict:
    """The trainer's defaults at this checkout, stamped on every training result beside the data
    service's (``datasvc.tools.bench.provenance.stamp``)."""
    from trainer.config import TrainerConfig

    return {"trainer": TrainerConfig()}
