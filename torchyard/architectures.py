"""The image classification architectures a job may name, without importing torchvision.

The API checks ``model.architecture`` against this list, and the API never imports torch
(README.md: the ``server`` extra installs no torch). The names are those of
``torchvision.models.list_models(module=torchvision.models)`` for the torchvision release
the ``worker`` extra pins; tests/test_packaging.py compares the two, so a torchvision
upgrade that adds or drops a model fails there until this list follows.
"""

from __future__ import annotations

import difflib

#: torchvision classification models (detection, segmentation and video models excluded).
CLASSIFICATION_ARCHITECTURES: frozenset[str] = frozenset(
    {
        "alexnet",
        "convnext_base",
        "convnext_large",
        "convnext_small",
        "convnext_tiny",
        "densenet121",
        "densenet161",
        "densenet169",
        "densenet201",
        "efficientnet_b0",
        "efficientnet_b1",
        "efficientnet_b2",
        "efficientnet_b3",
        "efficientnet_b4",
        "efficientnet_b5",
        "efficientnet_b6",
        "efficientnet_b7",
        "efficientnet_v2_l",
        "efficientnet_v2_m",
        "efficientnet_v2_s",
        "googlenet",
        "inception_v3",
        "maxvit_t",
        "mnasnet0_5",
        "mnasnet0_75",
        "mnasnet1_0",
        "mnasnet1_3",
        "mobilenet_v2",
        "mobilenet_v3_large",
        "mobilenet_v3_small",
        "regnet_x_16gf",
        "regnet_x_1_6gf",
        "regnet_x_32gf",
        "regnet_x_3_2gf",
        "regnet_x_400mf",
        "regnet_x_800mf",
        "regnet_x_8gf",
        "regnet_y_128gf",
        "regnet_y_16gf",
        "regnet_y_1_6gf",
        "regnet_y_32gf",
        "regnet_y_3_2gf",
        "regnet_y_400mf",
        "regnet_y_800mf",
        "regnet_y_8gf",
        "resnet101",
        "resnet152",
        "resnet18",
        "resnet34",
        "resnet50",
        "resnext101_32x8d",
        "resnext101_64x4d",
        "resnext50_32x4d",
        "shufflenet_v2_x0_5",
        "shufflenet_v2_x1_0",
        "shufflenet_v2_x1_5",
        "shufflenet_v2_x2_0",
        "squeezenet1_0",
        "squeezenet1_1",
        "swin_b",
        "swin_s",
        "swin_t",
        "swin_v2_b",
        "swin_v2_s",
        "swin_v2_t",
        "vgg11",
        "vgg11_bn",
        "vgg13",
        "vgg13_bn",
        "vgg16",
        "vgg16_bn",
        "vgg19",
        "vgg19_bn",
        "vit_b_16",
        "vit_b_32",
        "vit_h_14",
        "vit_l_16",
        "vit_l_32",
        "wide_resnet101_2",
        "wide_resnet50_2",
    }
)


def closest_architecture(name: str) -> str | None:
    """The classification model a mistyped ``name`` most likely means (other case, swapped
    or missing characters), or None when no model name is close."""
    by_lower = {known.lower(): known for known in CLASSIFICATION_ARCHITECTURES}
    wanted = name.lower()
    if wanted in by_lower:
        return by_lower[wanted]
    close = difflib.get_close_matches(wanted, sorted(by_lower), n=1, cutoff=0.75)
    return by_lower[close[0]] if close else None
