"""Hostile ONNX models, built with the ``onnx`` package: each takes ``input`` (N, 3, S, S)
and gives ``logits`` (N, 3), as a three-class model directory's export does."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
from onnx import TensorProto, helper

CLASSES = ["a", "b", "c"]


def _model(nodes: list[onnx.NodeProto], extra: list[onnx.TensorProto] | None = None) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "attack",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])],
        initializer=extra or [],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _pooled() -> list[onnx.NodeProto]:
    return [
        helper.make_node("GlobalAveragePool", ["input"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"]),
    ]


def plain_model() -> onnx.ModelProto:
    """Allowed operators only: the pooled channels are the logits."""
    return _model([*_pooled(), helper.make_node("Identity", ["flat"], ["logits"])])


def loop_model(iterations: int = 10**7) -> onnx.ModelProto:
    """A ``Loop`` adding 1 ``iterations`` times before it answers (CPU time per request)."""
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Add", ["v_in", "one"], ["v_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_in", TensorProto.FLOAT, []),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_out", TensorProto.FLOAT, []),
        ],
        initializer=[helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])],
    )
    nodes = [
        *_pooled(),
        helper.make_node("Loop", ["trips", "cond", "start"], ["total"], body=body),
        helper.make_node("Add", ["flat", "total"], ["logits"]),
    ]
    extra = [
        helper.make_tensor("trips", TensorProto.INT64, [], [iterations]),
        helper.make_tensor("cond", TensorProto.BOOL, [], [True]),
        helper.make_tensor("start", TensorProto.FLOAT, [], [0.0]),
    ]
    return _model(nodes, extra)


def constant_of_shape_model(elements: int = 256 * 1024**2) -> onnx.ModelProto:
    """A ``ConstantOfShape`` of ``elements`` floats (1 GiB by default) from a few bytes of file."""
    nodes = [
        *_pooled(),
        helper.make_node(
            "ConstantOfShape",
            ["shape"],
            ["big"],
            value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]),
        ),
        helper.make_node("ReduceSum", ["big"], ["total"], keepdims=0),
        helper.make_node("Add", ["flat", "total"], ["logits"]),
    ]
    return _model(nodes, [helper.make_tensor("shape", TensorProto.INT64, [1], [elements])])


def write_model_dir(folder: Path, model: onnx.ModelProto, image_size: int = 32) -> Path:
    """The two files scoring reads: ``config.json`` and ``model.onnx``."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "format_version": 1,
        "architecture": "resnet18",
        "classes": CLASSES,
        "num_classes": len(CLASSES),
        "image_size": image_size,
    }
    (folder / "config.json").write_text(json.dumps(config))
    onnx.save(model, str(folder / "model.onnx"))
    return folder
