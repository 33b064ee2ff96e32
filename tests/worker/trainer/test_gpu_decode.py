"""GPU decoding of training images (worker.trainer.gpu_decode) and the side-stream batch feed.

The decoding classes run on any device: here on the CPU, where torchvision decodes with
libjpeg, and on CUDA (nvJPEG) in the GPU-marked test at the end.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from torchyard.modeldir import IMAGENET_MEAN, IMAGENET_STD, image_directory_samples, load_rgb_image
from torchyard.sample_data import write_photos
from worker.trainer.data import train_transform
from worker.trainer.gpu_decode import (
    EncodedBatch,
    EncodedTrainSet,
    GpuDecoder,
    encoded_collate,
    gpu_decode_wanted,
    gpu_decode_works,
)
from worker.trainer.loop import BatchPreparer, DecodeThenPrepare, device_batches

# Mean absolute difference (0..255 scale) allowed between the decoder's and PIL's pixels.
GEOMETRY_TOLERANCE = 6.0


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    write_photos(root, classes=3, train_per_class=4, val_per_class=1)
    # One PNG among the JPEGs: decoded by the loader worker, not the GPU.
    png = root / "train" / "class-00" / "extra.png"
    Image.open(next((root / "train" / "class-00").glob("*.jpg"))).save(png)
    return root


def _samples(root: Path) -> list[tuple[str, int]]:
    classes = sorted(p.name for p in (root / "train").iterdir())
    return image_directory_samples(str(root / "train"), classes)


def test_jpegs_travel_encoded_and_other_formats_as_transformed_pixels(photos: Path) -> None:
    samples = _samples(photos)
    dataset = EncodedTrainSet(samples, train_transform(32, "light"))
    kinds = {}
    for index, (path, target) in enumerate(samples):
        payload, is_jpeg, label = dataset[index]
        assert label == target
        kinds[Path(path).suffix] = is_jpeg
        if is_jpeg:
            assert payload.tobytes() == Path(path).read_bytes()
        else:
            assert payload.dtype == np.uint8 and payload.shape == (3, 32, 32)
    assert kinds == {".jpg": True, ".png": False}
    batch = encoded_collate([dataset[i] for i in range(len(dataset))])
    assert batch.targets.tolist() == [t for _, t in samples]
    assert sum(batch.is_jpeg) == len(samples) - 1


@pytest.mark.parametrize("augmentation", ["standard", "light", "none"])
def test_decoded_batches_have_the_training_geometry(photos: Path, augmentation: str) -> None:
    samples = _samples(photos)
    dataset = EncodedTrainSet(samples, train_transform(48, augmentation))  # type: ignore[arg-type]
    batch = encoded_collate([dataset[i] for i in range(len(dataset))])
    images, targets = GpuDecoder(torch.device("cpu"), 48, augmentation)(batch)  # type: ignore[arg-type]
    assert images.dtype == torch.uint8 and images.shape == (len(samples), 3, 48, 48)
    assert torch.equal(targets, batch.targets)
    # Real pixels, not an empty buffer: each image has texture.
    assert all(float(img.float().std()) > 5.0 for img in images)


def test_without_augmentation_the_decoder_matches_the_cpu_transform(photos: Path) -> None:
    samples = [s for s in _samples(photos) if s[0].endswith(".jpg")][:4]
    cpu = train_transform(64, "none")
    expected = torch.stack([cpu(load_rgb_image(path)) for path, _ in samples]).float()
    dataset = EncodedTrainSet(samples, cpu)
    images, _ = GpuDecoder(torch.device("cpu"), 64, "none")(
        encoded_collate([dataset[i] for i in range(len(samples))])
    )
    # Same geometry; only the resampling filters differ (PIL's triangle, roi_align's box average).
    assert (images.float() - expected).abs().mean() < GEOMETRY_TOLERANCE
    # The bound is tight enough to see a crop three pixels off.
    assert (images.float().roll(3, dims=-1) - expected).abs().mean() > 2 * GEOMETRY_TOLERANCE


def test_the_augmented_crop_follows_the_global_seed(photos: Path) -> None:
    samples = _samples(photos)
    dataset = EncodedTrainSet(samples, train_transform(32, "standard"))
    batch = encoded_collate([dataset[i] for i in range(len(dataset))])
    decoder = GpuDecoder(torch.device("cpu"), 32, "standard")
    torch.manual_seed(7)
    first, _ = decoder(batch)
    torch.manual_seed(7)
    again, _ = decoder(batch)
    torch.manual_seed(8)
    other, _ = decoder(batch)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_device_batches_prepare_every_batch_once_in_order() -> None:
    device = torch.device("cpu")
    prepare = BatchPreparer(device, IMAGENET_MEAN, IMAGENET_STD)
    loader = [(torch.full((2, 3, 4, 4), i, dtype=torch.uint8), torch.tensor([i, i])) for i in range(5)]
    out = list(device_batches(loader, prepare, device))
    assert [int(labels[0]) for _, labels in out] == [0, 1, 2, 3, 4]
    assert all(batch.dtype == torch.float32 for batch, _ in out)

    class Decoder:
        def __call__(self, batch: EncodedBatch) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.zeros((len(batch.payloads), 3, 4, 4), dtype=torch.uint8), batch.targets

    encoded = [
        EncodedBatch([np.zeros(3, np.uint8)] * 2, [True, True], torch.tensor([k, k])) for k in range(3)
    ]
    decoded = list(device_batches(encoded, DecodeThenPrepare(Decoder(), prepare), device))
    assert [int(labels[0]) for _, labels in decoded] == [0, 1, 2]


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHYARD_GPU_DECODE", raising=False)
    assert gpu_decode_wanted()
    for off in ("0", "off", "false"):
        monkeypatch.setenv("TORCHYARD_GPU_DECODE", off)
        assert not gpu_decode_wanted()
    monkeypatch.setenv("TORCHYARD_GPU_DECODE", "sometimes")
    with pytest.raises(ValueError, match="TORCHYARD_GPU_DECODE"):
        gpu_decode_wanted()
    assert not gpu_decode_works(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a GPU machine)")
def test_nvjpeg_decodes_like_pil(photos: Path) -> None:
    device = torch.device("cuda", 0)
    assert gpu_decode_works(device)
    samples = [s for s in _samples(photos) if s[0].endswith(".jpg")][:4]
    cpu = train_transform(64, "none")
    expected = torch.stack([cpu(load_rgb_image(path)) for path, _ in samples]).float()
    dataset = EncodedTrainSet(samples, cpu)
    batch = encoded_collate([dataset[i] for i in range(len(samples))])
    prepare = BatchPreparer(device, IMAGENET_MEAN, IMAGENET_STD)
    images, _ = GpuDecoder(device, 64, "none")(batch)
    assert images.device.type == "cuda"
    assert (images.float().cpu() - expected).abs().mean() < GEOMETRY_TOLERANCE
    fed = list(
        device_batches([batch, batch], DecodeThenPrepare(GpuDecoder(device, 64, "none"), prepare), device)
    )
    assert len(fed) == 2 and fed[0][0].shape == (4, 3, 64, 64)
    assert fed[0][0].is_contiguous(memory_format=torch.channels_last)


def test_a_share_of_the_jpegs_is_decoded_by_the_workers(photos: Path) -> None:
    samples = [s for s in _samples(photos) if s[0].endswith(".jpg")] * 25  # 300 JPEG samples
    transform = train_transform(32, "light")
    assert sum(EncodedTrainSet(samples, transform, 0.0)[i][1] for i in range(len(samples))) == len(samples)
    assert sum(EncodedTrainSet(samples, transform, 1.0)[i][1] for i in range(len(samples))) == 0
    on_gpu = sum(EncodedTrainSet(samples, transform, 0.35)[i][1] for i in range(len(samples)))
    assert abs(on_gpu / len(samples) - 0.65) < 0.05


def test_the_cpu_share_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.trainer.gpu_decode import DEFAULT_CPU_SHARE, cpu_share

    monkeypatch.delenv("TORCHYARD_GPU_DECODE_CPU_SHARE", raising=False)
    assert cpu_share() == DEFAULT_CPU_SHARE
    monkeypatch.setenv("TORCHYARD_GPU_DECODE_CPU_SHARE", "0.5")
    assert cpu_share() == 0.5
    for bad in ("1.5", "-0.1", "half"):
        monkeypatch.setenv("TORCHYARD_GPU_DECODE_CPU_SHARE", bad)
        with pytest.raises(ValueError, match="from 0 to 1"):
            cpu_share()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a GPU machine)")
def test_the_feeder_thread_hands_its_errors_to_the_training_thread() -> None:
    from torchyard.contract.errors import InvalidDatasetError

    def prepare(images: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if int(targets[0]) == 2:
            raise InvalidDatasetError("cannot read image 'broken.jpg'")
        return images.cuda(), targets.cuda()

    loader = [(torch.zeros(2, 3, 4, 4), torch.tensor([i, i])) for i in range(4)]
    seen = []
    with pytest.raises(InvalidDatasetError, match="broken"):
        for _, labels in device_batches(loader, prepare, torch.device("cuda", 0)):
            seen.append(int(labels[0]))
    assert seen == [0, 1]


@pytest.mark.parametrize("augmentation", ["standard", "light"])
def test_crop_boxes_follow_the_random_resized_crop_rule(augmentation: str) -> None:
    from worker.trainer.gpu_decode import CROP_POLICY, crop_boxes

    (low, high), (ratio_low, ratio_high), flip = CROP_POLICY[augmentation]
    torch.manual_seed(5)
    sizes = torch.tensor([[375, 500], [500, 333], [224, 224], [40, 400]] * 500)
    boxes, flips = crop_boxes(sizes, augmentation)  # type: ignore[arg-type]
    left, top, width, height = boxes.unbind(1)
    h, w = sizes[:, 0].double(), sizes[:, 1].double()
    assert bool(((left >= 0) & (top >= 0) & (left + width <= w) & (top + height <= h)).all())
    assert bool(((width >= 1) & (height >= 1)).all())
    # Crops drawn (not the fallback) keep the area and aspect bounds, up to rounding.
    area = width * height / (h * w)
    aspect = width / height
    drawn = (sizes[:, 0] != 40).nonzero()[:, 0]
    assert float(area[drawn].min()) >= low * 0.9 and float(area[drawn].max()) <= high + 1e-9
    assert float(aspect[drawn].min()) >= ratio_low * 0.9 and float(aspect[drawn].max()) <= ratio_high * 1.1
    # The 40 x 400 strip fits no draw of the light policy: the centre crop at the widest ratio.
    if augmentation == "light":
        strip = boxes[3]
        assert strip.tolist() == [(400 - 44) // 2, 0.0, 44.0, 40.0]
    share = float(flips.double().mean())
    assert (0.45 < share < 0.55) if flip else share == 0.0
