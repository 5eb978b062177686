"""NeMo AutoModel 0.7.0 with its own VLM packing, as an AutoModel user packs Qwen3-VL samples.

AutoModel pins transformers 5.18 and the rank's environment holds 5.12, so its packer runs in a
process of its own under ``.venv-automodel`` (``trainer.bench.automodel_packer``: its
``PreTokenizedDatasetWrapper`` running the Hugging Face Qwen3-VL processor per sample in its
DataLoader workers, the same per-sample work as every peer; ``neat_pack_dataset_vlm`` planning the
packs from metadata with ``greedy_knapsack_vt_balanced``; its THD collater). That process streams
micro-batches of MBS packed rows in the rank's contract over a pipe, and the rank trains them
through the same packed THD step as vlmfeed and Energon.
"""
from __future__ import annotations

import os
import signal
import subprocess

from datasvc.batch import TrainBatch
from trainer.bench.peers_data import PeerSetting

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Where .ci/bootstrap builds AutoModel's environment; VLMFEED_AUTOMODEL_PYTHON points elsewhere.
DEFAULT_PYTHON = os.path.join(ROOT, ".venv-automodel", "bin", "python")
# The DataLoader's own read-ahead: each worker holds this many micro-batches (PyTorch's default).
PREFETCH_FACTOR = 2


def automodel_python() -> str | None:
    """The interpreter of AutoModel's environment, or None where it was not built."""
    python = os.environ.get("VLMFEED_AUTOMODEL_PYTHON", DEFAULT_PYTHON)
    return python if os.access(python, os.X_OK) else None


def packer_command(python: str, setting: PeerSetting, *, pad_id: int, num_workers: int, dp_rank: int,
                   dp_size: int) -> list[str]:
    return [python, "-m", "trainer.bench.automodel_packer", "--shards", *setting.shards,
            "--seq-len", str(setting.seq_len), "--mbs", str(setting.mbs), "--min-pixels", str(setting.min_pixels),
            "--max-pixels", str(setting.max_pixels), "--pipeline", setting.pipeline, "--pad-id", str(pad_id),
            "--num-workers", str(num_workers), "--dp-rank", str(dp_rank), "--dp-size", str(dp_size)]


class AutoModelPackedPath:
    """One rank's AutoModel packer process, yielding the rank's contract. ``plan`` is AutoModel's
    plan for the rank's data: each pack's sample keys, in the order the packs are served (ascending
    vision tokens)."""

    name = "automodel-packed"

    def __init__(self, setting: PeerSetting, work_dir: str, *, pad_id: int, num_workers: int, dp_rank: int = 0,
                 dp_size: int = 1):
        python = automodel_python()
        if python is None:
            raise RuntimeError(f"no AutoModel environment at {DEFAULT_PYTHON}: run .ci/bootstrap "
                               "(or set VLMFEED_AUTOMODEL_PYTHON to a Python with nemo-automodel 0.7.0)")
        self.setting = setting
        os.makedirs(work_dir, exist_ok=True)
        self.log_path = os.path.join(work_dir, f"automodel-packer-{dp_rank}.log")
        self._log = open(self.log_path, "wb")
        # The repository on the path: AutoModel's environment does not install it.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(
            packer_command(python, setting, pad_id=pad_id, num_workers=num_workers, dp_rank=dp_rank,
                           dp_size=dp_size),
            # Its own process group: its DataLoader workers can be ended with it.
            stdout=subprocess.PIPE, stderr=self._log, cwd=ROOT, env=env, start_new_session=True)
        self.plan: list[list[str]] = self._read()["bins"]
        # The workers' read-ahead, past which a warm-up measures the steady state.
        samples_per_pack = sum(map(len, self.plan)) / max(1, len(self.plan))
        packs_ahead = max(1, num_workers) * PREFETCH_FACTOR * setting.mbs
        self.buffered_samples = max(1, round(packs_ahead * samples_per_pack))

    def _read(self):
        from trainer.bench.automodel_packer import read_frame

        frame = read_frame(self.process.stdout)
        if frame is None:
            code = self.process.wait(timeout=30)
            with open(self.log_path, "rb") as f:
                tail = f.read()[-3000:].decode(errors="replace")
            raise RuntimeError(f"the AutoModel packer ended (exit {code}); its log {self.log_path} ends:\n{tail}")
        return frame

    def __iter__(self):
        return self

    def __next__(self) -> TrainBatch:
        return TrainBatch(**self._read())

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process.stdout.close()
        self._log.close()
