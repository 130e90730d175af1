"""Load the weights Burn's MNIST example trained into the same network written in torch.

The file ``mnist-model.bpk`` was written by Burn itself (``examples/mnist-inference-web``). Burn
stores ``Linear`` weights as ``[in, out]`` and names BatchNorm's affine parameters ``gamma`` /
``beta``; :class:`~lightning_bpk.interop.BurnToPyTorchAdapter` translates both from the torch
layer types, so the torch module below needs nothing but the same submodule names.

MNIST itself cannot be downloaded here, so the digits are the UCI handwritten digits committed
with the examples (``digits_data``: 1797 real handwritten digits, 8x8, values 0..16), brought
to MNIST's form: scaled to a 20x20 box (bicubic: MNIST digits are anti-aliased with sharp
strokes) centred in 28x28, values in [0, 1], then normalised with MNIST's mean 0.1307 and std
0.3081, as Burn's example does.

Run: ``.venv/bin/python examples/burn_mnist_interop.py [path/to/mnist-model.bpk]``; without a
path it reads the copy committed with the tests (``tests/fixtures/burn/``, described there).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from digits_data import load_digits
from torch import nn

from lightning_bpk.interop import BurnToPyTorchAdapter, load_module_record

# Burn's file as committed in this repository (see tests/fixtures/README.md)
FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "burn" / "mnist-model.bpk"
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # Burn's normalisation (the MNIST training set's stats)
MNIST_SIDE, MNIST_BOX = 28, 20  # MNIST digits fill a 20x20 box centred in 28x28
DIGITS_MAX = 16.0  # the digits' pixels are counts 0..16


class ConvBlock(nn.Module):
    """Burn's ``ConvBlock``: Conv2d (valid padding) -> BatchNorm -> ReLU -> MaxPool 2x2."""

    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels_in, channels_out, kernel_size=3)
        self.norm = nn.BatchNorm2d(channels_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(F.relu(self.norm(self.conv(x))), kernel_size=2, stride=2)


class MnistNet(nn.Module):
    """Burn's MNIST ``Model``, field for field: conv1, conv2, fc1 (GELU), fc2 (GELU), fc3."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = ConvBlock(1, 64)  # 28 -> 26 -> 13
        self.conv2 = ConvBlock(64, 64)  # 13 -> 11 -> 5
        self.fc1 = nn.Linear(64 * 5 * 5, 128)
        self.fc2 = nn.Linear(128, 128)
        self.fc3 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv2(self.conv1(x)).flatten(1)
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


def load_burn_mnist(path: str | Path = FIXTURE) -> MnistNet:
    """The torch network with Burn's trained weights, in eval mode."""
    net = MnistNet()
    load_module_record(path).apply(net, adapter=BurnToPyTorchAdapter())
    return net.eval()


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The handwritten digits as MNIST-like ``[N, 1, 28, 28]`` inputs, and labels."""
    pixels, labels = load_digits()
    images = torch.tensor(pixels, dtype=torch.float32)[:, None] / DIGITS_MAX
    box = F.interpolate(images, size=(MNIST_BOX, MNIST_BOX), mode="bicubic", align_corners=False)
    pad = (MNIST_SIDE - MNIST_BOX) // 2
    images = F.pad(box.clamp(0.0, 1.0), (pad, pad, pad, pad))
    return (images - MNIST_MEAN) / MNIST_STD, torch.tensor(labels)


def accuracy(net: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of ``images`` the network classifies as ``labels``."""
    with torch.no_grad():
        return (net(images).argmax(dim=1) == labels).float().mean().item()


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else FIXTURE
    if not path.is_file():
        print(f"no such file: {path} (usage: burn_mnist_interop.py [mnist-model.bpk])")
        return 2
    net = load_burn_mnist(path)
    images, labels = digits()
    print(
        f"Burn MNIST weights in torch: accuracy {accuracy(net, images, labels):.2%} "
        f"on {len(labels)} UCI digits (chance: 10%)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
