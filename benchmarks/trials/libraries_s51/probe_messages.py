"""What a user meets plugging library models in: messages and warnings.

Needs the s51 trial venv (torch 2.14.1, torchvision 0.29.1, timm 1.0.31, transformers 5.25.0; see
benchmarks/results/user_trial_libraries-s51.md), run from this folder with PYTHONPATH at the
repository root; no test runs it.
"""

# ruff: noqa: E402, F403, F405

import numpy as np
import torch

torch.set_num_threads(1)
from models import *
from ref import reported

from skpathkernel import PathKernelClassifier, PathRecorder
from skpathkernel.rules import layer_routes

show = reported


from transformers import BertForSequenceClassification

cfg = bert_config(dropout=None)
torch.manual_seed(0)
raw = BertForSequenceClassification(cfg)
print("training mode after construction:", raw.training)
X = data("ids", 8)
y = torch.randn(8, 3)
show("layer_routes(raw HF model)", lambda: layer_routes(raw, X))
opt = torch.optim.SGD(raw.parameters(), lr=0.05)


def loop(m, opt, X, y, out=lambda o: o.logits):
    with PathRecorder(m, opt, n_samples=len(X)) as rec:
        for _ in range(2):
            opt.zero_grad()
            (0.5 * (out(m(X)) - y).pow(2).mean()).backward()
            rec.set_batch(np.arange(len(X)))
            opt.step()
    return rec


show("own loop, raw model in train mode (dropout 0.1)", lambda: loop(raw, opt, X, y))
raw.eval()
opt = torch.optim.SGD(raw.parameters(), lr=0.05)
rec = None


def g():
    global rec
    rec = loop(raw, opt, X, y)
    return rec


show("own loop, eval", g)
show("as_estimator(raw HF model)", lambda: rec.as_estimator(X, y).path_kernel_(X[:2]))


# estimator with module= factory
def factory(n_features_in, n_outputs):
    c = bert_config(n_outputs, dropout=None)
    return Logits(BertForSequenceClassification(c))


labels = np.arange(8) % 3
show(
    "PathKernelClassifier(module=HF factory, train-mode dropout)",
    lambda: (
        PathKernelClassifier(module=factory, max_iter=2, tol=None, random_state=0)
        .fit(X.numpy(), labels)
        .score(X.numpy(), labels)
    ),
)


def factory_eval(n_features_in, n_outputs):
    return factory(n_features_in, n_outputs).eval()


show(
    "PathKernelClassifier(module=HF factory .eval())",
    lambda: (
        PathKernelClassifier(module=factory_eval, max_iter=2, tol=None, random_state=0)
        .fit(X.numpy(), labels)
        .decompose(X.numpy()[:2])
        .error
    ),
)


def factory_raw(n_features_in, n_outputs):
    c = bert_config(n_outputs, dropout=None)
    return BertForSequenceClassification(c).eval()


show(
    "PathKernelClassifier(module=raw HF model returning ModelOutput)",
    lambda: PathKernelClassifier(module=factory_raw, max_iter=2, tol=None, random_state=0).fit(
        X.numpy(), labels
    ),
)
# timm in train mode with drop_path
import timm


def tfac(n_features_in, n_outputs):
    return timm.create_model(
        "vit_tiny_patch16_224", num_classes=n_outputs, drop_path_rate=0.1, **TIMM_VIT
    )


Xi = data("img", 8).float().numpy()
show(
    "PathKernelClassifier(module=timm vit, drop_path 0.1, train mode)",
    lambda: (
        PathKernelClassifier(module=tfac, max_iter=2, tol=None, random_state=0)
        .fit(Xi, labels)
        .decompose(Xi[:2])
        .error
    ),
)
import torchvision


def rfac(n_features_in, n_outputs):
    return torchvision.models.resnet18(num_classes=n_outputs)


show(
    "PathKernelClassifier(module=tv resnet18, BN train mode)",
    lambda: PathKernelClassifier(module=rfac, max_iter=1, tol=None, random_state=0).fit(Xi, labels),
)
