"""The model: layers over an `ops` backend, a sequential CNN over one flat parameter vector, the
registry of named models, and test-set evaluation of bound weights.

    layers.py      Conv2d, ReLU, MaxPool2d, Flatten, Linear, SoftmaxCrossEntropy
    model.py       Model: layers + softmax cross-entropy, parameters in one flat float32 vector
    registry.py    MODELS (digits, cifar10, cifar10_deep) and build_model
    evaluation.py  evaluate: summed loss and correct count of bound weights on test images

    from mpiasgd.model import build_model, evaluate
    model = build_model("digits")                    # numpy backend, unbound
"""

from mpiasgd.model.evaluation import evaluate
from mpiasgd.model.model import Model
from mpiasgd.model.registry import MODELS, ModelSpec, build_model

__all__ = ["MODELS", "Model", "ModelSpec", "build_model", "evaluate"]
