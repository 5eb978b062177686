"""Realistic synthetic image-text shards: ``vlmfeed synth`` (``python -m datasvc.tools.synth``).

Why this exists: image-free mock data makes a VLM data path look about twice as fast as it is,
because decoding and resizing real photographs is where the CPU time goes. The shards written
here cost what real ones cost: real JPEG/PNG bytes whose content has natural-image statistics
(1/f spectra, occlusion boundaries, textures, sensor grain), photo-like bytes per pixel, realistic
resolutions, aspect ratios, formats, images per sample and caption lengths. Video members are real
photos filmed by a virtual camera and encoded by FFmpeg's encoders at the data's lengths, frame
rates, sizes, codecs, bitrates and keyframe intervals. ``--mock`` writes the image-free variant with
the identical text, so the two can be compared head to head.

A :class:`Profile` is a set of distributions. Seven are built in (:data:`PROFILES`); ``calibrate``
fits one to real shards from headers and sizes only (no pixel decode, no model, nothing unpickled).

Output layout (WebDataset): ``DIR/synth-000000.tar``, ... Each sample has ``__key__``, its
image(s) as ``jpg``/``png`` (several images: ``0.jpg``, ``1.png``, ... in order), its video(s) as
``webm``/``mp4``/``mkv``/``mov`` (``0.webm``, ...), and either ``txt`` (a caption) or ``json`` (a
single-turn conversation whose user turn holds one ``<image>`` marker per image, then one ``<video>``
per video, each taken in key order). Output is byte-identical for identical arguments (H.264 clips
excepted: x264's rate control varies from run to run): every sample draws from its own random
stream seeded by ``(seed, sample index)``.

- ``dist``: distributions and profiles; ``text``: captions and conversations; ``images``: natural
  scenes and their encoding; ``documents``: pages and screenshots; ``videos``: clips and their
  header facts; ``write``: samples and shards;
  ``calibrate``: statistics of real shards and a profile fitted to them; ``cli``: the command.
"""
from datasvc.tools.synth.calibrate import calibrate, estimate_jpeg_quality, image_statistics
from datasvc.tools.synth.dist import PROFILES, Dist, Profile
from datasvc.tools.synth.write import cached_profile_shards, write_shards

__all__ = ["Dist", "Profile", "PROFILES", "write_shards", "calibrate", "image_statistics", "estimate_jpeg_quality"]
