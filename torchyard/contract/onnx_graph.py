"""The operators of an ONNX model, read straight from its protobuf (no ``onnx`` package),
and the allow-list a model registered from a script job's outputs must keep to.

A model directory a script wrote is untrusted: before the API scores it, its graph may use
only the operators torchvision classifiers export to (convolutions, pooling, matrix
products, normalizations, activations, shape plumbing), from the default ONNX domain, with
no local functions. ``Loop``, ``Scan``, ``If`` (unbounded work) and ``ConstantOfShape`` (a
tensor of any size from a few bytes of file) are refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator

# What torchvision's classification architectures export to (opset 17, TorchScript exporter),
# plus their close variants (dropout, clip for ReLU6, GELU...).
ALLOWED_OPERATORS = frozenset(
    {
        "Abs", "Add", "ArgMax", "AveragePool", "BatchNormalization", "Cast", "Clip", "Concat", "Constant",
        "Conv", "Div", "Dropout", "Equal", "Erf", "Exp", "Expand", "Flatten", "Gather", "Gelu", "Gemm",
        "GlobalAveragePool", "GlobalMaxPool", "HardSigmoid", "HardSwish", "Identity", "LayerNormalization",
        "LeakyRelu", "Log", "LRN", "MatMul", "Max", "MaxPool", "Min", "Mod", "Mul", "Neg", "Not", "Pad",
        "Pow", "PRelu", "Range", "Reciprocal", "ReduceMax", "ReduceMean", "ReduceSum", "Relu", "Reshape",
        "ScatterND", "Shape", "Sigmoid", "Slice", "Softmax", "Softplus", "Split", "Sqrt", "Squeeze", "Sub",
        "Tanh", "Transpose", "Unsqueeze", "Where",
    }
)  # fmt: skip
_DEFAULT_DOMAINS = ("", "ai.onnx")
# ModelProto.graph, ModelProto.functions, GraphProto.node, NodeProto.op_type, NodeProto.domain.
_MODEL_GRAPH, _MODEL_FUNCTIONS, _GRAPH_NODE, _NODE_OP_TYPE, _NODE_DOMAIN = 7, 25, 1, 4, 7


class OnnxGraphError(ValueError):
    """The file is not an ONNX model this service scores; the message says why."""


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise OnnxGraphError("model.onnx is not a valid ONNX protobuf (truncated)")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(data: memoryview) -> Iterator[tuple[int, memoryview | None]]:
    """``(field number, bytes)`` of each length-delimited field; None for the other kinds."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(data, pos)
            yield number, None
        elif wire == 1:
            pos += 8
            yield number, None
        elif wire == 5:
            pos += 4
            yield number, None
        elif wire == 2:
            size, pos = _varint(data, pos)
            if pos + size > len(data):
                raise OnnxGraphError("model.onnx is not a valid ONNX protobuf (truncated)")
            yield number, data[pos : pos + size]
            pos += size
        else:
            raise OnnxGraphError(f"model.onnx is not a valid ONNX protobuf (wire type {wire})")


def graph_operators(model: bytes) -> list[tuple[str, str]]:
    """``(domain, op_type)`` of every node of the model's main graph, in order."""
    data = memoryview(model)
    graphs = []
    for number, value in _fields(data):
        if number == _MODEL_FUNCTIONS:
            raise OnnxGraphError("model.onnx defines local functions, which are not accepted")
        if number == _MODEL_GRAPH and value is not None:
            graphs.append(value)
    if len(graphs) != 1:
        raise OnnxGraphError("model.onnx holds no graph")
    return [_node(node) for number, node in _fields(graphs[0]) if number == _GRAPH_NODE and node is not None]


def _node(node: memoryview) -> tuple[str, str]:
    found = {_NODE_OP_TYPE: "", _NODE_DOMAIN: ""}
    for field, value in _fields(node):
        if value is not None and field in found:
            found[field] = bytes(value).decode("utf-8", errors="replace")
    return found[_NODE_DOMAIN], found[_NODE_OP_TYPE]


def check_operators(model: bytes) -> None:
    """Raise :class:`OnnxGraphError` naming the first operator outside the allow-list."""
    for domain, op_type in graph_operators(model):
        if domain not in _DEFAULT_DOMAINS:
            raise OnnxGraphError(
                f"model.onnx uses the operator {domain}:{op_type}, outside the default ONNX domain"
            )
        if op_type not in ALLOWED_OPERATORS:
            raise OnnxGraphError(
                f"model.onnx uses the operator {op_type!r}, which torchvision classifiers do not export "
                "to: not accepted in a model registered from a script job's outputs"
            )
