"""Datasets for the recipes, read from disk without downloads (the papers' splits, docs/papers.md).

``build_datasets(recipe, data_root, seed, meta_fraction=0.0) -> Splits(train, val, test, meta)``:

| dataset | expected under ``data_root`` | train / validation / test |
|---|---|---|
| ``digits`` | nothing (scikit-learn's bundled 8×8 digits, 1797 images) | seeded 200 (recipe ``train_subset``) / 500 / 1097 |
| ``cifar10`` | ``cifar-10-batches-py/`` (torchvision's format) | seeded 90 % / 10 % of the 50k train (45k/5k) / test batch |
| ``cifar100`` | ``cifar-100-python/`` | same |
| ``tinyimagenet`` | ``tiny-imagenet-200/`` (or the folder itself): ``wnids.txt``, ``train/<wnid>/images/*``, ``val/val_annotations.txt`` + ``val/images/*`` | train minus 50 images per class / those 50 per class / official val |
| ``imagenet`` | ``train/<class>/*`` and ``val/<class>/*`` (ImageFolder) | train minus 10 per class / those 10 per class / val |
| any, ``synthetic_size=N`` | nothing (:func:`synthetic_datasets`: seeded random images of the recipe's shape) | N / N // 10 / N // 10 |

Validation (used to fit the temperature) and test are always different images. ``meta`` (meta-regularisation's
held-out batch source, docs/papers.md) is carved from train when ``meta_fraction > 0`` and overlaps neither
validation nor test. A missing or malformed data directory raises :class:`DataError` saying what was expected.
"""

from __future__ import annotations

import math
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from .recipes import Recipe, get_recipe

__all__ = ["DataError", "Splits", "build_datasets", "TransformedSubset", "SyntheticImages", "synthetic_datasets"]

CIFAR_VALIDATION_FRACTION = 0.1          # 45k / 5k
TINYIMAGENET_VAL_PER_CLASS = 50
IMAGENET_VAL_PER_CLASS = 10
DIGITS_VAL, DIGITS_TEST = 500, 1097      # the remaining 200 are the recipe's train_subset
SYNTHETIC_HELD_OUT_DIVISOR = 10          # synthetic validation and test: N // 10 images each
SYNTHETIC_POOL_BYTES = 64 * 2**20        # distinct float32 images per synthetic split (then they repeat)
SYNTHETIC_SIGNAL = 0.5                   # amplitude of the class pattern added to unit Gaussian noise

_MEAN_STD = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "tinyimagenet": ((0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821)),
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}


class DataError(RuntimeError):
    """The data directory is missing or not in the expected on-disk format."""


@dataclass
class Splits:
    train: Dataset
    val: Dataset
    test: Dataset
    meta: Dataset | None = None
    num_classes: int | None = None


class TransformedSubset(Dataset):
    """``dataset[indices[i]]`` with ``transform`` applied to the image, so one decoded dataset can serve splits with
    different augmentation (train) and none (validation/test)."""

    def __init__(self, dataset, indices, transform=None):
        self.dataset, self.indices, self.transform = dataset, [int(i) for i in indices], transform

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, index):
        image, target = self.dataset[self.indices[index]]
        if self.transform is not None:
            image = self.transform(image)
        return image, target


def _seeded_permutation(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n)


def _split_meta(train_indices: np.ndarray, meta_fraction: float, seed: int):
    """Carve ``meta_fraction`` of the training indices out as the meta split (seeded, disjoint)."""
    if not 0.0 <= meta_fraction < 1.0:
        raise ValueError(f"meta_fraction must be in [0, 1), got {meta_fraction}")
    if meta_fraction == 0.0:
        return train_indices, None
    order = np.random.default_rng(seed + 1).permutation(len(train_indices))
    n_meta = max(1, int(round(meta_fraction * len(train_indices))))
    return train_indices[order[n_meta:]], train_indices[order[:n_meta]]


def _per_class_holdout(targets: np.ndarray, per_class: int, seed: int):
    """Hold out ``per_class`` random indices of every class; return ``(kept, held_out)`` index arrays."""
    rng = np.random.default_rng(seed)
    kept, held = [], []
    for cls in np.unique(targets):
        members = rng.permutation(np.flatnonzero(targets == cls))
        if len(members) <= per_class:
            raise DataError(f"class {cls} has only {len(members)} training images; holding out {per_class} per class "
                            "as validation needs more")
        held.append(members[:per_class])
        kept.append(members[per_class:])
    return np.sort(np.concatenate(kept)), np.sort(np.concatenate(held))


# ----------------------------------------------------------------------------------------------------------- digits
def _digits(recipe: Recipe, seed: int, meta_fraction: float) -> Splits:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0   # (1797, 1, 8, 8) in [0, 1]
    images = (images - 0.5) / 0.5
    targets = torch.tensor(bunch.target, dtype=torch.int64)
    order = _seeded_permutation(len(targets), seed)
    test_idx, val_idx = order[:DIGITS_TEST], order[DIGITS_TEST:DIGITS_TEST + DIGITS_VAL]
    train_idx = order[DIGITS_TEST + DIGITS_VAL:]
    if recipe.train_subset is not None:
        train_idx = train_idx[:recipe.train_subset]
    train_idx, meta_idx = _split_meta(train_idx, meta_fraction, seed)

    def subset(idx):
        idx = torch.as_tensor(np.sort(idx))
        return TensorDataset(images[idx], targets[idx])

    return Splits(subset(train_idx), subset(val_idx), subset(test_idx),
                  subset(meta_idx) if meta_idx is not None else None, num_classes=10)


# ------------------------------------------------------------------------------------------------------------ CIFAR
def _cifar_transforms(dataset: str, image_size: int):
    from torchvision import transforms as T

    mean, std = _MEAN_STD[dataset]
    if image_size == 32:
        train = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
        test = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    else:  # fine-tuning a 224-px model on CIFAR: upsample
        train = T.Compose([T.Resize(image_size), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
        test = T.Compose([T.Resize(image_size), T.ToTensor(), T.Normalize(mean, std)])
    return train, test


def _cifar(recipe: Recipe, root: Path, seed: int, meta_fraction: float, download: bool) -> Splits:
    from torchvision.datasets import CIFAR10, CIFAR100

    base = CIFAR10 if recipe.dataset == "cifar10" else CIFAR100
    folder = root / base.base_folder
    expected = (f"torchvision's {recipe.dataset.upper()} python format: {folder}/ holding "
                + ", ".join(name for name, _ in base.train_list + base.test_list) + f", {base.meta['filename']} "
                "(pass --download to fetch it)")

    class _OnDisk(base):
        # torchvision verifies the published MD5 sums, which would reject any re-packed or fixture copy; we check that
        # the files exist and let unpickling report corruption instead.
        def _check_integrity(self):
            return all((folder / name).is_file() for name, _ in self.train_list + self.test_list)

        def _load_meta(self):
            path = folder / self.meta["filename"]
            if not path.is_file():
                raise RuntimeError(f"{path} not found")
            with path.open("rb") as handle:
                self.classes = pickle.load(handle, encoding="latin1")[self.meta["key"]]
            self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    try:
        if download:
            base(str(root), train=True, download=True)
        train_full = _OnDisk(str(root), train=True, download=False)
        test_full = _OnDisk(str(root), train=False, download=False)
    except (RuntimeError, pickle.UnpicklingError, EOFError, KeyError, ValueError, OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{recipe.dataset}: could not read {folder} ({type(exc).__name__}: {exc}); expected "
                        f"{expected}") from exc
    if (train_full.data.ndim != 4 or train_full.data.shape[1:] != (32, 32, 3)
            or len(train_full.targets) != len(train_full.data)):
        raise DataError(f"{recipe.dataset}: malformed data in {folder}: images of shape "
                        f"{train_full.data.shape[1:]} (expected 32x32x3); expected {expected}")
    num_classes = recipe.num_classes
    for split in (train_full, test_full):
        if len(split.targets) and not 0 <= min(split.targets) <= max(split.targets) < num_classes:
            raise DataError(f"{recipe.dataset}: labels outside [0, {num_classes}) in {folder}")
    train_tf, test_tf = _cifar_transforms(recipe.dataset, recipe.image_size)
    order = _seeded_permutation(len(train_full), seed)
    n_val = max(1, int(round(CIFAR_VALIDATION_FRACTION * len(order))))
    val_idx, train_idx = np.sort(order[:n_val]), np.sort(order[n_val:])
    train_idx, meta_idx = _split_meta(train_idx, meta_fraction, seed)
    return Splits(
        TransformedSubset(train_full, train_idx, train_tf),
        TransformedSubset(train_full, val_idx, test_tf),
        TransformedSubset(test_full, range(len(test_full)), test_tf),
        TransformedSubset(train_full, meta_idx, test_tf) if meta_idx is not None else None,
        num_classes=num_classes,
    )


# ------------------------------------------------------------------------------------------------ Tiny-ImageNet
class TinyImageNetVal(Dataset):
    """The official Tiny-ImageNet validation set: ``val/images/*.JPEG`` labelled by ``val/val_annotations.txt``
    (``filename<TAB>wnid<TAB>x0<TAB>y0<TAB>x1<TAB>y1`` per line)."""

    def __init__(self, root: Path, class_to_idx: dict[str, int]):
        from torchvision.datasets.folder import default_loader

        self.loader = default_loader
        annotations = root / "val" / "val_annotations.txt"
        self.samples = []
        for line_no, line in enumerate(annotations.read_text().splitlines(), 1):
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) < 2 or fields[1] not in class_to_idx:
                raise DataError(f"tinyimagenet: {annotations} line {line_no} is malformed or names an unknown class: "
                                f"{line!r}")
            path = root / "val" / "images" / fields[0]
            if not path.is_file():
                raise DataError(f"tinyimagenet: {annotations} line {line_no} names {path}, which does not exist")
            self.samples.append((str(path), class_to_idx[fields[1]]))
        if not self.samples:
            raise DataError(f"tinyimagenet: {annotations} lists no images")
        self.targets = [t for _, t in self.samples]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        path, target = self.samples[index]
        return self.loader(path), target


def _imagenet_style_transforms(dataset: str, image_size: int):
    from torchvision import transforms as T

    mean, std = _MEAN_STD[dataset]
    if dataset == "tinyimagenet":
        # Train and evaluation see the image at the same scale: both resize it to image_size first (a no-op for the
        # 64-px images at the recipe's 64), then training takes a padded random crop (4 px at 64, scaled with the
        # size) where evaluation takes the centre. Cropping a 64-px image to a smaller size without resizing would
        # train on objects larger than those evaluated, and a larger size could not be cropped at all.
        padding = max(1, round(4 * image_size / 64))
        train = T.Compose([T.Resize(image_size), T.RandomCrop(image_size, padding=padding), T.RandomHorizontalFlip(),
                           T.ToTensor(), T.Normalize(mean, std)])
        test = T.Compose([T.Resize(image_size), T.CenterCrop(image_size), T.ToTensor(), T.Normalize(mean, std)])
    else:
        train = T.Compose([T.RandomResizedCrop(image_size), T.RandomHorizontalFlip(), T.ToTensor(),
                           T.Normalize(mean, std)])
        test = T.Compose([T.Resize(int(image_size * 256 / 224)), T.CenterCrop(image_size), T.ToTensor(),
                          T.Normalize(mean, std)])
    return train, test


def _image_folder(path: Path, what: str, expected: str):
    from torchvision.datasets import ImageFolder

    if not path.is_dir():
        raise DataError(f"{what}: {path} does not exist; expected {expected}")
    try:
        return ImageFolder(str(path))
    except (FileNotFoundError, RuntimeError, OSError) as exc:
        raise DataError(f"{what}: could not read {path} ({exc}); expected {expected}") from exc


def _tinyimagenet(recipe: Recipe, root: Path, seed: int, meta_fraction: float) -> Splits:
    if (root / "tiny-imagenet-200").is_dir():
        root = root / "tiny-imagenet-200"
    expected = ("the official Tiny-ImageNet layout under <data-root>/tiny-imagenet-200/ (or <data-root> itself): "
                "wnids.txt, train/<wnid>/images/*.JPEG, val/val_annotations.txt and val/images/*.JPEG")
    if not (root / "val" / "val_annotations.txt").is_file():
        raise DataError(f"tinyimagenet: {root / 'val' / 'val_annotations.txt'} does not exist; expected {expected}")
    train_full = _image_folder(root / "train", "tinyimagenet", expected)
    wnids_file = root / "wnids.txt"
    if wnids_file.is_file():
        wnids = sorted(w.strip() for w in wnids_file.read_text().split() if w.strip())
        if wnids != train_full.classes:
            raise DataError(f"tinyimagenet: the class folders in {root / 'train'} do not match {wnids_file}")
    test = TinyImageNetVal(root, train_full.class_to_idx)
    train_tf, test_tf = _imagenet_style_transforms("tinyimagenet", recipe.image_size)
    return _held_out_folder_splits(train_full, test, TINYIMAGENET_VAL_PER_CLASS, train_tf, test_tf, seed, meta_fraction)


def _imagenet(recipe: Recipe, root: Path, seed: int, meta_fraction: float) -> Splits:
    expected = "an ImageFolder layout: <data-root>/train/<class>/*.JPEG and <data-root>/val/<class>/*.JPEG"
    train_full = _image_folder(root / "train", "imagenet", expected)
    test_full = _image_folder(root / "val", "imagenet", expected)
    if test_full.classes != train_full.classes:
        raise DataError(f"imagenet: the class folders of {root / 'val'} differ from those of {root / 'train'}")
    train_tf, test_tf = _imagenet_style_transforms("imagenet", recipe.image_size)
    return _held_out_folder_splits(train_full, test_full, IMAGENET_VAL_PER_CLASS, train_tf, test_tf, seed,
                                   meta_fraction)


def _held_out_folder_splits(train_full, test, per_class: int, train_tf, test_tf, seed: int,
                            meta_fraction: float) -> Splits:
    """Validation = ``per_class`` seeded training images of each class; test = the official split; meta from train."""
    targets = np.asarray(train_full.targets)
    if np.bincount(targets).min() <= per_class:   # tiny fixtures: hold out a fifth of each class instead
        per_class = max(1, int(np.bincount(targets).min()) // 5)
    train_idx, val_idx = _per_class_holdout(targets, per_class, seed)
    train_idx, meta_idx = _split_meta(train_idx, meta_fraction, seed)
    return Splits(
        TransformedSubset(train_full, train_idx, train_tf),
        TransformedSubset(train_full, val_idx, test_tf),
        TransformedSubset(test, range(len(test)), test_tf),
        TransformedSubset(train_full, meta_idx, test_tf) if meta_idx is not None else None,
        num_classes=len(train_full.classes),
    )


# -------------------------------------------------------------------------------------------------------- synthetic
class SyntheticImages(Dataset):
    """``length`` samples drawn in turn from a fixed pool: sample ``i`` is ``(images[i % P], targets[i % P])``.

    Indexing returns views of the pool, so a batch costs one stack and no decoding, augmentation or file access: the
    data cannot be what limits a throughput measurement. :meth:`to` moves the pool, e.g. onto the GPU that trains on
    it, where a batch is then one stack of device tensors with no host copy or transfer."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, length: int):
        if len(images) != len(targets) or len(images) < 1 or length < 1:
            raise ValueError(f"SyntheticImages needs a non-empty pool and length >= 1, got {len(images)} images, "
                             f"{len(targets)} targets, length {length}")
        self.images, self.targets, self.length = images, targets, int(length)

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        if not -self.length <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} synthetic samples")
        index = index % self.length % len(self.targets)
        return self.images[index], self.targets[index]

    def to(self, device) -> "SyntheticImages":
        """The same samples with the pool on ``device``."""
        return SyntheticImages(self.images.to(device), self.targets.to(device), self.length)


def synthetic_datasets(recipe: Recipe, size: int, seed: int, meta_fraction: float = 0.0) -> Splits:
    """Random images of ``recipe``'s shape (``in_channels`` x ``image_size`` x ``image_size``) and classes, for
    pipeline tests and throughput measurements without a data set: ``size`` training images (less the meta split's
    ``meta_fraction``), ``size // 10`` validation and as many test images. Nothing is read or downloaded.

    Each split cycles through its own pool of at most ``SYNTHETIC_POOL_BYTES`` of distinct float32 images (111 at
    224 px, 5461 at 32 px), so validation, test and meta images differ from the training images. An image is unit
    Gaussian noise plus its class's fixed random 4 x 4 pattern per channel (upsampled, amplitude
    ``SYNTHETIC_SIGNAL``), with the classes balanced within each pool: a model can learn them, so training, the
    temperature fit and the calibration report see non-degenerate logits (their numbers say nothing about real data).
    Pool image ``i`` has class ``i mod C`` (then shuffled), so a pool smaller than the number of classes C holds
    only classes ``0 … P-1``, the same in every split: ImageNet-shaped pools at 224 px have 111 of the 1000 classes
    (the model still has all C outputs). Covering all 1000 would take 1000 distinct images, 602 MB per split, about
    10 x the pool budget that keeps ``--workers 0`` pools on the device.
    Everything is drawn from one generator seeded with ``seed``: the same arguments give the same tensors."""
    if size < 1:
        raise ValueError(f"the synthetic data set needs at least 1 training image, got {size}")
    train_idx, meta_idx = _split_meta(np.arange(size), meta_fraction, seed)
    if len(train_idx) == 0:
        raise ValueError(f"--synthetic-size {size} leaves no training image after the meta split "
                         f"(--meta-fraction {meta_fraction})")
    shape = (recipe.in_channels, recipe.image_size, recipe.image_size)
    num_classes = recipe.num_classes
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randn(num_classes, shape[0], 4, 4, generator=generator)
    pool_cap = max(1, SYNTHETIC_POOL_BYTES // (4 * math.prod(shape)))

    def split(length: int) -> SyntheticImages:
        pool = min(length, pool_cap)
        targets = (torch.arange(pool) % num_classes)[torch.randperm(pool, generator=generator)]
        images = torch.randn(pool, *shape, generator=generator)
        images += SYNTHETIC_SIGNAL * torch.nn.functional.interpolate(patterns[targets], size=shape[1:],
                                                                     mode="nearest")
        return SyntheticImages(images, targets, length)

    held_out = max(1, size // SYNTHETIC_HELD_OUT_DIVISOR)
    return Splits(split(len(train_idx)), split(held_out), split(held_out),
                  split(len(meta_idx)) if meta_idx is not None else None, num_classes=num_classes)


def build_datasets(recipe: Recipe | str, data_root: str | os.PathLike | None, seed: int,
                   meta_fraction: float = 0.0, download: bool = False, synthetic_size: int | None = None) -> Splits:
    """Train / validation / test (/ meta) datasets of ``recipe`` (see the module docstring for layouts and splits).

    The splits depend only on ``seed`` (not on the process or rank), so every DDP rank and every resumed run sees the
    same ones. ``download=True`` lets torchvision fetch CIFAR; nothing else is ever downloaded. ``synthetic_size=N``
    replaces the data set by :func:`synthetic_datasets` with N training images (``data_root`` is not used).
    """
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    if synthetic_size is not None:
        return synthetic_datasets(recipe, synthetic_size, seed, meta_fraction)
    if recipe.dataset == "digits":
        return _digits(recipe, seed, meta_fraction)
    if data_root is None:
        raise DataError(f"{recipe.dataset}: --data-root is required for recipe {recipe.name!r}")
    root = Path(data_root).expanduser()
    if not root.is_dir():
        raise DataError(f"{recipe.dataset}: data root {root} does not exist (recipe {recipe.name!r}); expected "
                        + {"cifar10": "a folder holding cifar-10-batches-py/ (torchvision's format; --download "
                                      "fetches it)",
                           "cifar100": "a folder holding cifar-100-python/ (torchvision's format; --download "
                                       "fetches it)",
                           "tinyimagenet": "a folder holding tiny-imagenet-200/ (wnids.txt, train/, val/)",
                           "imagenet": "a folder holding train/ and val/ in ImageFolder layout"}[recipe.dataset])
    if recipe.dataset in ("cifar10", "cifar100"):
        return _cifar(recipe, root, seed, meta_fraction, download)
    if recipe.dataset == "tinyimagenet":
        return _tinyimagenet(recipe, root, seed, meta_fraction)
    if recipe.dataset == "imagenet":
        return _imagenet(recipe, root, seed, meta_fraction)
    raise ValueError(f"recipe {recipe.name!r} has unknown dataset {recipe.dataset!r}")
