"""The engine service: one engine per worker process, split by concern.

- ``intake``: the pending-request record, and turning a request (``GenerationRequest``, defined in
  ``batchery.contract.generation`` with ``GenerationResult``) into engine input;
- ``admission``: the quarantine lane (solo runs, one at a time, each in engine steps of its own);
- ``loop``: the loop thread (gathering bursts, applying operations, stepping, resolving futures);
- ``canary``, ``triage``, ``supervisor``: after a failure, who pays, who is carried over, the
  canary, rebuilding and giving up;
- ``logprobs``: rendering logprobs with token texts;
- ``stats``, ``step_stats``, ``state``: the typed counters, the per-step histograms, the state enum;
- ``shared``: the state the threads share; ``faults``: fault injection into engine steps;
- ``api``: ``EngineService``, the API the tasks and the entry point use.

Imports only the engine and the contract (never the Celery worker above it). Importing this
package does not import torch: the engine is imported when the first engine is built."""

from batchery.contract.generation import GenerationRequest, GenerationResult
from batchery.worker.service.api import EngineService
from batchery.worker.service.state import EngineState

__all__ = ["EngineService", "EngineState", "GenerationRequest", "GenerationResult"]
