"""Who computes what: replicas and pipeline stages (``topology``), the layers each stage holds (``stageplan``),
the layout a run starts with (``placement``), a stage's part of the model (``stagemodel``), the pipeline's step
(``pipeline``), and what a rank computes each step in its layout (``engine``)."""
