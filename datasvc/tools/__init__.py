"""User tools around the data service, each a ``vlmfeed`` subcommand (``datasvc.tools.cli``).

- ``inspect``: what a rank receives for given shards, written out sample by sample.
- ``profile``: the data path's throughput on its own, with a verdict against a trainer's demand.
- ``synth``: realistic synthetic image-text shards, or image-free mock ones for contrast.
- ``bench``: decode, service, soak and block-sizing benchmarks.

The product (``datasvc``) never imports anything from here.
"""
