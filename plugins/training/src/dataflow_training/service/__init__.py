"""The persistent trainer (``dataflow serve-trainer``): a process that keeps one compiled
step and its weights alive between calls, served on a local socket (docs/engine_service.md).
``protocol`` (framing, requests; light), ``batches`` (the batch kinds ``step`` reads),
``served_run`` (one method per verb), ``kinds`` (the trainer kinds plugins add: the
server's side of ``dataflow_trainer_kinds``), ``weights_export``, ``server`` (the socket side),
``client`` (``TrainerClient``; light). Users import ``TrainerClient``, ``ServiceError`` and
``write_token_batch`` from ``dataflow_training``."""
