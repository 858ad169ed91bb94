"""The model: layers over an `ops` backend, a CNN over one flat parameter vector (and one of buffers),
networks as stored definitions, the built-in networks, export, and test-set evaluation of bound weights.

    layers.py      the layer contract (Param, Buffer, Context) and the layers: Conv2d, Linear, ReLU,
                   MaxPool2d, AvgPool2d, GlobalAvgPool, BatchNorm2d, Dropout, LocalResponseNorm,
                   SubsamplePad, Flatten, Residual; SoftmaxCrossEntropy
    model.py       Model: layers + softmax cross-entropy, parameters and buffers in flat float32 vectors
    spec.py        a network's stored definition (JSON data), --model references (built-in, PATH.py:FUNC,
                   PATH.json)
    registry.py    MODELS (digits, cifar10, cifar10_deep, resnet20, resnet56, and networks.py's) and
                   build_model
    networks.py    the papers' networks: cifar10_18pct, alexnet_1gpu (224 and 64)
    export.py      weights and buffers as .npz by name; PyTorch state_dict names of the built-ins
    evaluation.py  evaluate: summed loss, top-1 and top-5 correct counts of bound weights on test images

    from mpiasgd.model import build_model, evaluate
    model = build_model("digits")                    # numpy backend, unbound
"""

from mpiasgd.model.evaluation import Evaluation, evaluate
from mpiasgd.model.model import Model
from mpiasgd.model.registry import MODELS, ModelSpec, build_model

__all__ = ["MODELS", "Evaluation", "Model", "ModelSpec", "build_model", "evaluate"]
