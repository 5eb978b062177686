"""Evidence runs for a GPU machine, outside the product (nothing in trainer/ imports this package).

- ``cases``: the training cases, in groups named by what they measure.
- ``training``: ``python -m trainer.bench``, each case a real ``python -m trainer.run`` job.
- ``decode``: ``python -m trainer.bench --gpu-decode-only``, bytes to pixel rows / pixel_values on
  DALI GPU, DALI CPU and torchvision nvJPEG.
- ``plots``: ``python -m trainer.bench.plots``, figures and tables from the results.
- ``gpu_proof``: ``python -m trainer.bench.gpu_proof``, packed row == samples alone, and the
  Megatron-Bridge loop on synthetic rows.
"""
