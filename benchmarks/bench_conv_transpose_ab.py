"""One-process A/B of the transposed convolutions' (and Conv3d's) rules: the generic
fallback (ref) vs the rule (tree).

``nn.ConvTranspose1d/2d/3d`` and ``nn.Conv3d`` had no rule: their weights went to the exact
but slower ``torch.func`` fallback. The rules are taken out of the registry (``RULES``) for the ref
side and put back for the tree side, the two alternating in one process; each case is
``tangent_gram`` (the trace Gram) of ``N`` samples, timed by ``time.thread_time`` on one
torch thread (the CPU time of the calling thread: a shared machine's load does not
count).

Cases (float32):

- a DCGAN-style generator: a latent ``(32, 1, 1)`` upsampled by transposed convolutions
  to 4x4 (64 channels, kernel 4), 8x8 (32, kernel 4, stride 2, padding 1) and 16x16 (8,
  kernel 4, stride 2, padding 1), ReLU between, tanh, a Linear head on the 16x16 map; one
  output and ten; the same with the middle layer grouped (groups = 4);
- an upsampling decoder from a 4x4 map: ``(32, 4, 4)`` -> 8x8 (64) -> 16x16 (32, groups 1)
  -> 32x32 (16, kernel 3, output_padding 1), a 3x3 convolution to 3 channels, 4x4
  average pooling, a Linear head (more positions per layer: the rule's gradient blocks
  take the same Gram product as the fallback's per-sample gradients, so less to gain);
- the same DCGAN with depthwise (groups = channels) upsampling layers;
- a 3-D generator: a latent ``(16, 1, 1, 1)`` to 4^3 (32 channels, kernel 4) and 8^3 (8,
  kernel 4, stride 2, padding 1), tanh, a Linear head;
- a small 3-D CNN (``nn.Conv3d``, the conv rule on 3-D patches): ``(2, 8, 8, 8)``, a 3x3x3
  convolution to ``c`` channels (padding 1), one to ``2c`` (stride 2), ReLU between, 2^3
  average pooling, a Linear head; ``c`` = 8 and 32.

Usage: ``OMP_NUM_THREADS=1 python -m benchmarks.bench_conv_transpose_ab [RESULTS [N]]``
(RESULTS ``conv_transpose_ab``, N 256). Writes ``benchmarks/results/RESULTS.md`` and
``.json``.
"""

import os
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from benchmarks._ab import ab_provenance, rules_ab, write_ab

ROOT = Path(__file__).resolve().parent.parent
REPS = 5
TYPES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Conv3d)


def _dcgan(n_out, groups=1, width=32, z=32):
    return nn.Sequential(
        nn.ConvTranspose2d(z, 2 * width, 4, 1, 0, bias=False), nn.ReLU(),  # 1 -> 4
        nn.ConvTranspose2d(2 * width, width, 4, 2, 1, bias=False, groups=groups),  # -> 8
        nn.ReLU(), nn.ConvTranspose2d(width, 8, 4, 2, 1), nn.Tanh(),  # 8 -> 16
        nn.Flatten(), nn.Linear(8 * 16 * 16, n_out)).eval()


def _depthwise(n_out, width=64, z=32):
    return nn.Sequential(
        nn.ConvTranspose2d(z, width, 4, 1, 0), nn.ReLU(),  # 1 -> 4
        nn.ConvTranspose2d(width, width, 4, 2, 1, groups=width), nn.ReLU(),  # -> 8
        nn.ConvTranspose2d(width, width, 4, 2, 1, groups=width), nn.ReLU(),  # -> 16
        nn.Conv2d(width, 4, 1), nn.Flatten(), nn.Linear(4 * 16 * 16, n_out)).eval()


def _decoder(n_out, z=32, ch=(64, 32, 16)):
    return nn.Sequential(
        nn.ConvTranspose2d(z, ch[0], 4, stride=2, padding=1), nn.ReLU(),  # 4 -> 8
        nn.ConvTranspose2d(ch[0], ch[1], 4, stride=2, padding=1), nn.ReLU(),  # -> 16
        nn.ConvTranspose2d(ch[1], ch[2], 3, stride=2, padding=1, output_padding=1),  # -> 32
        nn.ReLU(), nn.Conv2d(ch[2], 3, 3, padding=1), nn.AdaptiveAvgPool2d(4),
        nn.Flatten(), nn.Linear(3 * 16, n_out)).eval()


def _generator3d(n_out):
    return nn.Sequential(
        nn.ConvTranspose3d(16, 32, 4, 1, 0), nn.ReLU(),  # 1 -> 4
        nn.ConvTranspose3d(32, 8, 4, 2, 1), nn.Tanh(),  # 4 -> 8
        nn.Flatten(), nn.Linear(8 * 8**3, n_out)).eval()


def _cnn3d(n_out, c):
    return nn.Sequential(
        nn.Conv3d(2, c, 3, padding=1), nn.ReLU(),
        nn.Conv3d(c, 2 * c, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool3d(2), nn.Flatten(), nn.Linear(16 * c, n_out)).eval()


def _cases(n):
    torch.manual_seed(0)
    latent, grid = torch.randn(n, 32, 1, 1), torch.randn(n, 32, 4, 4)
    latent3d, volume = torch.randn(n, 16, 1, 1, 1), torch.randn(n, 2, 8, 8, 8)
    return {
        f"DCGAN generator 1->4->8->16, N={n}, C=1": (_dcgan(1), latent),
        f"DCGAN generator 1->4->8->16, N={n}, C=10": (_dcgan(10), latent),
        f"DCGAN generator, middle layer groups=4, N={n}, C=1": (_dcgan(1, groups=4), latent),
        f"DCGAN generator, depthwise upsampling (groups=64), N={n}, C=1": (_depthwise(1),
                                                                           latent),
        f"decoder 4->8->16->32 + conv + pool, N={n}, C=1": (_decoder(1), grid),
        f"3-D generator 1->4->8 (ConvTranspose3d), N={n}, C=1": (_generator3d(1), latent3d),
        f"3-D CNN (Conv3d) c=8, N={n}, C=1": (_cnn3d(1, 8), volume),
        f"3-D CNN (Conv3d) c=32, N={n}, C=1": (_cnn3d(1, 32), volume),
    }


def main(results="conv_transpose_ab", n=256):
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    warnings.simplefilter("ignore")
    rows = rules_ab(_cases(int(n)), TYPES, REPS)
    prov = ab_provenance(ROOT, "bench_conv_transpose_ab",
                         ["skpathkernel/_tangent/_layers.py",
                          "benchmarks/bench_conv_transpose_ab.py"],
                         "the tree without the ConvTranspose1d/2d/3d and Conv3d rules (RULES "
                         "entries removed)", REPS)
    out = ROOT / "benchmarks" / "results" / results
    write_ab(out, "nn.ConvTranspose*d, nn.Conv3d: generic fallback (ref) vs their rules (tree)",
             "time.thread_time", prov, rows, 3, machine=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
