"""`medha route`: an OpenAI-compatible router over many replicas, dispatched by the same classes
as `medha simulate --replicas N --dispatcher X` (medha/dispatch). No torch, no engine."""
