"""The rules every side of the data path agrees on: rank → spool → agent → Parquet / Prometheus → dashboard.

One place for what a writer and a reader must never disagree about, so no side imports another side
for them (transport and collector import the contract, never the instrumentation):

- :mod:`.schema`: the versioned Arrow schema of every record kind, and the value vocabularies
  (``DIMS``, ``OPS``, ``SPAN_KINDS``, ``EVENT_KINDS``);
- :mod:`.records`: one named-tuple record type per kind, generated from the schema (rows are built by
  keyword);
- :mod:`.clock`: the time base records are stamped in;
- :mod:`.names`: run names, spool file names and Parquet part names (and the patterns that parse them);
- :mod:`.bandwidth`: the nccl-tests algbw / busbw definitions ranks record and the dashboard explains;
- :mod:`.formulas`: training FLOPs per token, the one spelling of a parallel layout (strategy) and a
  pipeline schedule's names and closed-form bubble;
- :mod:`.layout`: the rules of a parallel layout and the reference model's flavors, which the trainer
  runs and the planner predicts (neither imports the other).

- :mod:`.storelayout`: every path of the run store (spools, partitions, packs, the agent's state), local
  and in an object store.
"""

from meshscope.agent.contract.bandwidth import algbw, busbw, busbw_factor
from meshscope.agent.contract.clock import AnchoredClock, Clock
from meshscope.agent.contract.formulas import (
    bubble_theory, canonical_strategy, mfu, normalize_schedule, strategy_name, training_flops_per_token,
)
from meshscope.agent.contract.names import (
    PACK_RE, PART_RE, SPOOL_NAME, check_run_name, is_run_name, pack_name, part_name, spool_path,
)
from meshscope.agent.contract.records import (
    FACTORIES, RECORDS, TAGS, CollectiveRecord, EventRecord, GpuRecord, HangRecord, MemoryRecord, RunRecord, SpanRecord,
    StepRecord, collective_record, event_record, gpu_record, hang_record, memory_record, record_types, run_record, span_record, step_record,
)
from meshscope.agent.contract.schema import (
    DIMS, EVENT_KINDS, KINDS, OPS, P2P_OPS, SCHEMA_VERSION, is_stage_wait, SCHEMAS, SCHEMAS_BY_VERSION, SPAN_KINDS,
)

__all__ = [
    "DIMS", "EVENT_KINDS", "KINDS", "OPS", "P2P_OPS", "is_stage_wait", "PACK_RE", "PART_RE", "RECORDS", "SCHEMAS", "SCHEMAS_BY_VERSION", "SCHEMA_VERSION",
    "SPAN_KINDS", "SPOOL_NAME", "AnchoredClock", "Clock", "CollectiveRecord", "EventRecord", "GpuRecord",
    "MemoryRecord", "RunRecord", "SpanRecord", "StepRecord", "algbw", "busbw", "busbw_factor", "check_run_name", "is_run_name",
    "pack_name", "part_name", "record_types", "spool_path", "FACTORIES", "TAGS", "collective_record", "event_record", "gpu_record", "hang_record", "HangRecord",
    "memory_record", "run_record", "span_record", "step_record", "canonical_strategy", "strategy_name",
    "training_flops_per_token", "bubble_theory", "mfu", "normalize_schedule",
]
