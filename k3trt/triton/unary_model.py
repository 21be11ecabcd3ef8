"""The unary front (`k3_unary`): one response per request, for clients that cannot stream.

Triton refuses HTTP /infer and gRPC ModelInfer on decoupled models ("HTTP end point doesn't
support models with decoupled transaction policy"), and the engine model must be decoupled to
stream. This model is not decoupled; it forwards each request to the engine model with BLS
(`stream` forced false, so the engine answers with exactly one final response) and returns that
response or its error unchanged. It loads no engine and imports neither torch nor the runtime.
`execute` waits only until the engine model has taken or refused the request (it asks, with the
request parameter ACK_PARAMETER, for an empty response once taken): a refusal is answered there
and counted as this model's failure too (nv_inference_request_failure); see `execute` for how. A taken request then waits on its own thread, so requests stay
concurrent (a non-decoupled Python model may answer through the response sender since Triton 23.10).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
from typing import Any

import numpy as np

from k3trt.triton.metrics import forward_logs
from k3trt.triton.schema import ACK_PARAMETER, ERROR_PREFIX, OUTPUTS, error_kind

log = logging.getLogger(__name__)


class UnaryModel:
    def initialize(self, args: dict[str, Any], params: dict[str, str]) -> None:
        import triton_python_backend_utils as pb  # noqa: PLC0415 (optional: only inside Triton's backend)
        self.pb = pb
        forward_logs(pb)
        self.target = params["target_model"]
        self.name = json.loads(args["model_config"])["name"]
        log.info("k3trt unary front %s ready: forwards to %s", self.name, self.target)

    def execute(self, requests: list) -> list | None:
        """Triton counts a request as failed only when `execute` fails, and a non-decoupled model may
        not simply raise: the backend would answer the request again with an INTERNAL error (a 500)
        and free its response factory twice (a crash). So a refusal is sent through the response
        sender (the client gets the INVALID_ARG, a 400) and a response for it is also returned: the
        stub then finds the request's sender closed, fails `execute` while marking the factory as
        freed, and the backend counts the failure and answers nothing more (the request is closed)."""
        for request in requests:
            sender = request.get_response_sender()
            try:
                responses = iter(self._send(request))
                first = next(responses, None)
            except Exception as e:
                log.exception("forwarding to %s failed", self.target)
                self._error(sender, f"{ERROR_PREFIX['INTERNAL']}{type(e).__name__}: {e}")
                continue
            if first is not None and first.has_error():
                msg = first.error().message()
                self._error(sender, msg)
                if len(requests) == 1:       # counted as failed (see above)
                    return [self._error_response(msg)]
                continue
            threading.Thread(target=self._finish, args=(first, responses, sender), name="k3trt-unary",
                             daemon=True).start()
        return None

    def finalize(self) -> None:
        pass

    def _send(self, request: Any) -> Any:
        """The engine model's responses to `request`, sent as one non-streaming request."""
        pb = self.pb
        inputs = [t for t in request.inputs() if t.name() != "stream"]
        inputs.append(pb.Tensor("stream", np.array([False])))
        wanted = request.requested_output_names() or [t.name for t in OUTPUTS]
        bls = pb.InferenceRequest(model_name=self.target, requested_output_names=list(wanted), inputs=inputs,
                                  parameters={ACK_PARAMETER: True})
        return bls.exec(decoupled=True)

    def _finish(self, first: Any, responses: Any, sender: Any) -> None:
        pb, final = self.pb, self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            answer = None
            for response in itertools.chain([first] if first is not None else [], responses):
                if response.has_error():
                    self._error(sender, response.error().message())
                    return
                if response.output_tensors():
                    answer = response
            if answer is None:
                raise RuntimeError(f"{self.target} returned no response")
            sender.send(pb.InferenceResponse(output_tensors=answer.output_tensors()), flags=final)
        except Exception as e:
            log.exception("forwarding to %s failed", self.target)
            self._error(sender, f"{ERROR_PREFIX['INTERNAL']}{type(e).__name__}: {e}")

    def _error_response(self, msg: str) -> Any:
        """An error response; the code is lost across BLS, so it is read back from the message."""
        return self.pb.InferenceResponse(error=self.pb.TritonError(msg, getattr(self.pb.TritonError, error_kind(msg))))

    def _error(self, sender: Any, msg: str) -> None:
        try:
            sender.send(self._error_response(msg), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:
            log.warning("could not deliver the error %r", msg, exc_info=True)
