"""The job's data: records read and checked (``sources``, ``records``), rendered with a chat template
(``templates``), tokenized and packed into blocks (``blocks``), and the held-out evaluation (``evaluate``)."""
