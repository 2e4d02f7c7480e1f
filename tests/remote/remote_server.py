"""A stand-in for a remote nnsight server, run as its own process: nnterp cannot be imported here.

It reads requests ``{"model_key", "env", "compress", "blob"}`` from stdin (pickled, one after another), builds
the model named by the key (a plain nnsight ``TransformersModel`` over the checkpoint, as servers
host it), applies the request's environment, deserializes the payload against that model's own
module tree and runs it, as nnsight's server does. It answers on the original stdout with the
saved values (``torch.save`` bytes) or the error. Everything else it prints goes to stderr.
"""

import importlib.abc
import io
import os
import pickle
import sys
import traceback


class NoNnterp(importlib.abc.MetaPathFinder):
    """The server has torch, transformers and nnsight; importing nnterp fails as it would there."""

    def find_spec(self, name, path=None, target=None):
        if name == "nnterp" or name.startswith("nnterp."):
            raise ModuleNotFoundError(f"No module named {name!r} (this server does not have nnterp)")
        return None


sys.meta_path.insert(0, NoNnterp())
answers = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)  # stray prints must not corrupt the answers

import torch  # noqa: E402
from nnsight.modeling.mixins.remotable import Remotable  # noqa: E402
from nnsight.schema.request import RequestModel  # noqa: E402
from nnsight.tracing.tracer import dec, inc  # noqa: E402

torch.set_num_threads(1)
MODELS = {}


def run(request: dict) -> dict:
    key = request["model_key"]
    if key not in MODELS:
        MODELS[key] = Remotable.from_model_key(key, dispatch=True)
    model = MODELS[key]
    model._remoteable_set_env(request["env"])
    tracer = RequestModel.deserialize(request["blob"], model._remoteable_persistent_objects(),
                                      compress=request["compress"])
    frame = tracer.info.frame
    before = dict(frame.f_locals)
    inc()
    try:
        tracer.execute(tracer.info.code)
    finally:
        dec()
    return {name: value for name, value in frame.f_locals.items() if before.get(name, frame) is not value}


requests = os.fdopen(0, "rb")
while True:
    try:
        request = pickle.load(requests)
    except EOFError:
        break
    try:
        buffer = io.BytesIO()
        torch.save(run(request), buffer)
        answer = {"saves": buffer.getvalue()}
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the client
        answer = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    pickle.dump(answer, answers)
    answers.flush()
