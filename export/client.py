"""Small clients for a translator served by TF Serving.

REST needs nothing beyond the standard library; gRPC needs the
`tensorflow-serving-api` package (`pip install tensorflow-serving-api`, or
the project's `serving` extra), imported only when a `GrpcClient` is made.

    from export.client import RestClient, GrpcClient

    rest = RestClient("http://localhost:8501", "translator")
    rest.translate(["A man is riding a bike."])          # ["Ein Mann fährt Fahrrad."]
    rest.translate_with_scores(["A dog runs."])          # (["..."], [-0.53])
    rest.translate_batch(["A dog runs."])                # TranslatedBatch(translations, scores, truncated)
    rest.n_best(["A dog runs."]).translations            # [["...", "...", "...", "..."]]: best first
    rest.metadata()                                      # the signatures, as TF Serving reports them

    grpc_client = GrpcClient("localhost:8500", "translator")
    grpc_client.translate(["A man is riding a bike."])

Both send the `text` input of a signature (`serving_default`: beam search,
`greedy`: greedy decoding) and read its `translation`, `score` and
`truncated` outputs (`truncated`: the source was longer than the model's
limit and only its beginning was translated; False from exports older than
that output).
Strings that are not valid UTF-8 are sent base64-encoded over REST
(`{"b64": ...}`, TF Serving's convention for binary strings).

    python -m export.client --rest http://localhost:8501 "A man is riding a bike."
    python -m export.client --grpc localhost:8500 --metadata
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import urllib.error
import urllib.request
from typing import NamedTuple

TEXT_INPUT = "text"


class TranslatedBatch(NamedTuple):
    """A text signature's outputs for a batch, one entry per input text."""

    translations: list[str]
    scores: list[float]
    truncated: list[bool]  # the source was cut to the model's limit before it was translated


class ServingError(RuntimeError):
    """TF Serving answered with an error (its message is kept)."""


def _rest_value(text):
    if isinstance(text, str):
        return text
    try:
        return bytes(text).decode("utf-8")
    except UnicodeDecodeError:
        return {"b64": base64.b64encode(bytes(text)).decode("ascii")}


def _rest_text(value):
    if isinstance(value, dict) and "b64" in value:  # a binary string, as TF Serving encodes one
        return base64.b64decode(value["b64"]).decode("utf-8", errors="replace")
    return value


class RestClient:
    """TF Serving's REST API: `POST /v1/models/NAME[/versions/V]:predict` with
    `{"instances": [{"text": ...}, ...]}` (row format)."""

    def __init__(self, url="http://localhost:8501", model="translator", *, version=None,
                 signature="serving_default", timeout=60.0):
        self.url = url.rstrip("/")
        self.model, self.version, self.signature, self.timeout = model, version, signature, timeout

    def _model_url(self):
        url = f"{self.url}/v1/models/{self.model}"
        return url if self.version is None else f"{url}/versions/{self.version}"

    def _request(self, url, body=None):
        data = None if body is None else json.dumps(body).encode("utf-8")
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read().decode("utf-8"))
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", errors="replace")
            try:
                detail = json.loads(detail).get("error", detail)
            except ValueError:
                pass
            raise ServingError(f"TF Serving returned HTTP {e.code} for {url}: {detail}") from None

    def predict(self, texts, signature=None) -> list[dict]:
        """Row format: one `{"translation": str, "score": float}` per input text."""
        texts = list(texts)
        if not texts:
            return []
        # Named form ({"text": ...} per instance): unambiguous also for {"b64": ...} values.
        body = {"signature_name": signature or self.signature,
                "instances": [{TEXT_INPUT: _rest_value(t)} for t in texts]}
        predictions = self._request(self._model_url() + ":predict", body)["predictions"]
        if len(predictions) != len(texts):
            raise ServingError(f"Sent {len(texts)} texts, got {len(predictions)} predictions")
        return predictions

    def translate_batch(self, texts, signature=None) -> TranslatedBatch:
        """One signature's outputs for `texts`; with the `n_best` signature a list of translations and of
        scores per text."""
        predictions = self.predict(texts, signature)
        if predictions and "translations" in predictions[0]:  # n_best
            return TranslatedBatch([[_rest_text(t) for t in p["translations"]] for p in predictions],
                                   [[float(s) for s in p["scores"]] for p in predictions],
                                   [bool(p.get("truncated", False)) for p in predictions])
        return TranslatedBatch([_rest_text(p["translation"]) for p in predictions],
                               [float(p["score"]) for p in predictions],
                               [bool(p.get("truncated", False)) for p in predictions])

    def n_best(self, texts) -> TranslatedBatch:
        """The `n_best` signature: each text's n different translations and their scores, best first."""
        return self.translate_batch(texts, "n_best")

    def translate_with_scores(self, texts, signature=None):
        return self.translate_batch(texts, signature)[:2]

    def translate(self, texts, signature=None) -> list[str]:
        return self.translate_with_scores(texts, signature)[0]

    def metadata(self) -> dict:
        """`GET /v1/models/NAME[/versions/V]/metadata`: the model spec and its signature_def map."""
        return self._request(self._model_url() + "/metadata")

    def status(self) -> dict:
        """`GET /v1/models/NAME[/versions/V]`: the model's version states (AVAILABLE once loaded)."""
        return self._request(self._model_url())


class GrpcClient:
    """TF Serving's gRPC `PredictionService` (port 8500 by default). Needs `tensorflow-serving-api`."""

    def __init__(self, target="localhost:8500", model="translator", *, version=None, signature="serving_default",
                 timeout=60.0):
        try:
            import grpc
            from tensorflow_serving.apis import prediction_service_pb2_grpc
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("GrpcClient needs the tensorflow-serving-api package: "
                              "pip install tensorflow-serving-api (or keras-transformer[serving])") from e
        self.model, self.version, self.signature, self.timeout = model, version, signature, timeout
        self._channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20),
                                                               ("grpc.max_send_message_length", 64 << 20)])
        self._stub = prediction_service_pb2_grpc.PredictionServiceStub(self._channel)

    def _model_spec(self, spec, signature=None):
        spec.name = self.model
        if self.version is not None:
            spec.version.value = int(self.version)
        if signature is not False:
            spec.signature_name = signature or self.signature

    def predict(self, texts, signature=None):
        """Returns the raw `PredictResponse`."""
        from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2
        from tensorflow_serving.apis import predict_pb2

        texts = [t.encode("utf-8") if isinstance(t, str) else bytes(t) for t in texts]
        request = predict_pb2.PredictRequest()
        self._model_spec(request.model_spec, signature)
        tensor = tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING,
            tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=len(texts))]),
            string_val=texts)
        request.inputs[TEXT_INPUT].CopyFrom(tensor)
        return self._stub.Predict(request, timeout=self.timeout)

    def translate_batch(self, texts, signature=None) -> TranslatedBatch:
        texts = list(texts)
        if not texts:
            return TranslatedBatch([], [], [])
        from tensorflow import make_ndarray  # float outputs may come as float_val or packed tensor_content

        response = self.predict(texts, signature)
        many = "translations" in response.outputs  # n_best: [batch, n]
        translations = make_ndarray(response.outputs["translations" if many else "translation"]).tolist()
        translations = [[t.decode("utf-8", errors="replace") for t in row] if many
                        else row.decode("utf-8", errors="replace") for row in translations]
        scores = make_ndarray(response.outputs["scores" if many else "score"]).tolist()
        if len(translations) != len(texts):
            raise ServingError(f"Sent {len(texts)} texts, got {len(translations)} translations")
        truncated = ([bool(t) for t in make_ndarray(response.outputs["truncated"])]
                     if "truncated" in response.outputs else [False] * len(texts))
        return TranslatedBatch(translations, scores, truncated)

    def translate_with_scores(self, texts, signature=None):
        return self.translate_batch(texts, signature)[:2]

    def n_best(self, texts) -> TranslatedBatch:
        """The `n_best` signature: each text's n different translations and their scores, best first."""
        return self.translate_batch(texts, "n_best")

    def translate(self, texts, signature=None) -> list[str]:
        return self.translate_with_scores(texts, signature)[0]

    def metadata(self):
        """`GetModelMetadata` with `signature_def`: returns the `SignatureDefMap` proto."""
        from tensorflow_serving.apis import get_model_metadata_pb2

        request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
        self._model_spec(request.model_spec, signature=False)
        response = self._stub.GetModelMetadata(request, timeout=self.timeout)
        signatures = get_model_metadata_pb2.SignatureDefMap()
        response.metadata["signature_def"].Unpack(signatures)
        return signatures

    def close(self):
        self._channel.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m export.client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--rest", help="REST address, e.g. http://localhost:8501")
    where.add_argument("--grpc", help="gRPC address, e.g. localhost:8500")
    p.add_argument("--model-name", default="translator")
    p.add_argument("--signature", default="serving_default", help="serving_default (beam) or greedy")
    p.add_argument("--metadata", action="store_true", help="print the model's signatures instead")
    p.add_argument("texts", nargs="*", help="sentences to translate (default: lines of stdin)")
    args = p.parse_args(argv)
    client = (RestClient(args.rest, args.model_name, signature=args.signature) if args.rest
              else GrpcClient(args.grpc, args.model_name, signature=args.signature))
    if args.metadata:
        print(json.dumps(client.metadata(), indent=2) if args.rest else client.metadata())
        return 0
    texts = args.texts or [line.rstrip("\n") for line in sys.stdin]
    for translation, score in zip(*client.translate_with_scores(texts)):
        print(f"{score:.4f}\t{translation}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
