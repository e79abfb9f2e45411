"""A V2 gRPC call through the kserve SDK's own client (``kserve.InferenceGRPCClient``), run by
test_grpc_kserve.py in the environment that has the kserve SDK (``LMHEAD_KSERVE_PYTHON``):
``python kserve_client.py ADDRESS MODEL HIDDEN.npy {raw|typed}`` prints one JSON line."""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
from kserve import InferenceGRPCClient, InferInput, InferRequest


async def main(address: str, model: str, hidden_path: str, encoding: str) -> None:
    hidden = np.load(hidden_path)
    async with InferenceGRPCClient(url=address, timeout=60) as client:
        health = {
            "live": await client.is_server_live(),
            "ready": await client.is_server_ready(),
            "model_ready": await client.is_model_ready(model),
        }
        tensor = InferInput(name="hidden_states", shape=list(hidden.shape), datatype="FP32")
        tensor.set_data_from_numpy(hidden, binary_data=encoding == "raw")
        request = InferRequest(model_name=model, infer_inputs=[tensor], parameters={"k": 3})
        response = await client.infer(request)
    outputs = {output.name: output.as_numpy().tolist() for output in response.outputs}
    print(json.dumps({**health, "version": response.model_version, "outputs": outputs}))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
