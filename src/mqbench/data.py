"""Offline data: scikit-learn's bundled digits (1797 8x8 images), split deterministically; crops of real photos.

:func:`sample_photos` gathers the photographs that ship with scikit-learn (2) and, where it is
installed, scikit-image (17 more); :func:`photo_crops` cuts random, deterministic crops of them,
resized and normalised as ImageNet models expect: real images to calibrate and evaluate an
ImageNet classifier on, offline. A user's own images come through an image folder
(``mqbench.app.folder``).

Example:
    >>> from mqbench.data import load_digits_split
    >>> train, test = load_digits_split()
    >>> train.images.shape[1:], len(train.images) + len(test.images)
    (torch.Size([1, 8, 8]), 1797)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "Split", "load_digits_split", "photo_crops", "sample_photos"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# scikit-image's natural photographs (grayscale ones as three equal channels); its synthetic,
# binary and microscopy-only images are left out.
SKIMAGE_PHOTOS = (
    "astronaut", "cat", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina",
    "camera", "clock", "coins", "brick", "grass", "gravel", "moon",
)  # fmt: skip


@dataclass(frozen=True)
class Split:
    images: Tensor  # [N, 1, 8, 8], pixel values scaled to [0, 1]
    labels: Tensor  # [N] int64

    def batches(self, batch_size: int, generator: torch.Generator | None = None):
        """Mini-batches, shuffled when a generator is given."""
        order = torch.randperm(len(self.labels), generator=generator) if generator else torch.arange(len(self.labels))
        for start in range(0, len(order), batch_size):
            index = order[start : start + batch_size]
            yield self.images[index], self.labels[index]


def load_digits_split(test_fraction: float = 0.25, seed: int = 0) -> tuple[Split, Split]:
    """The digits data set as (train, test) tensors; needs scikit-learn (``pip install mqbench[demo]``)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError(
            "the digits data set comes with scikit-learn; install it with `pip install 'mqbench[demo]'`"
        ) from error
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(len(labels) * (1 - test_fraction))
    train, test = order[:cut], order[cut:]
    return Split(images[train], labels[train]), Split(images[test], labels[test])


def sample_photos(require_skimage: bool = False) -> dict[str, Tensor]:
    """The bundled photographs by name, each ``[3, H, W]`` uint8: scikit-learn's two, then scikit-image's
    (its natural photos and the stereo pair) when it is installed (``require_skimage``: an error if not)."""
    try:
        from sklearn.datasets import load_sample_images
    except ImportError as error:
        raise ImportError("the sample photos come with scikit-learn: `pip install 'mqbench[demo]'`") from error
    sample = load_sample_images()
    arrays = {name.rsplit(".", 1)[0]: image for name, image in zip(sample.filenames, sample.images, strict=True)}
    arrays = {name.rsplit("/", 1)[-1]: image for name, image in arrays.items()}
    try:
        import skimage.data
    except ImportError as error:
        if require_skimage:
            raise ImportError("these photos need scikit-image: `pip install scikit-image`") from error
    else:
        for name in SKIMAGE_PHOTOS:
            arrays[name] = getattr(skimage.data, name)()
        left, right, _ = skimage.data.stereo_motorcycle()
        arrays["motorcycle_left"], arrays["motorcycle_right"] = left, right
    photos = {}
    for name, array in arrays.items():
        image = torch.tensor(numpy.array(array))
        image = image.unsqueeze(-1).expand(*image.shape, 3) if image.dim() == 2 else image[..., :3]
        photos[name] = image.permute(2, 0, 1).contiguous()
    return photos


def photo_crops(
    count: int,
    seed: int,
    size: int = 224,
    photos: dict[str, Tensor] | None = None,
    min_fraction: float = 0.35,
) -> Tensor:
    """``count`` random square crops of the photos, ``[count, 3, size, size]`` float, ImageNet-normalised.

    Each crop: a photo drawn uniformly, a side of ``min_fraction`` to 1 of the photo's shorter side,
    a position, a horizontal flip with probability 1/2, then an antialiased bilinear resize. The same
    ``seed`` gives the same crops on every machine; different seeds give different crops.
    """
    if count < 1 or size < 8:
        raise ValueError(f"photo_crops needs count >= 1 and size >= 8, got count={count}, size={size}")
    images = list((photos if photos is not None else sample_photos()).values())
    generator = torch.Generator().manual_seed(seed)
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    crops = []
    for _ in range(count):
        draws = torch.rand(5, generator=generator, dtype=torch.float64).tolist()
        image = images[min(int(draws[0] * len(images)), len(images) - 1)].float() / 255.0
        height, width = image.shape[1:]
        side = max(8, int(min(height, width) * (min_fraction + (1.0 - min_fraction) * draws[1])))
        top = int(draws[2] * (height - side + 1))
        left = int(draws[3] * (width - side + 1))
        crop = image[:, top : top + side, left : left + side]
        if draws[4] < 0.5:
            crop = crop.flip(-1)
        crop = F.interpolate(crop[None], size=(size, size), mode="bilinear", align_corners=False, antialias=True)[0]
        crops.append((crop - mean) / std)
    return torch.stack(crops)
