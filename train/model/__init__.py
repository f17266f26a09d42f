"""The model a rank trains: the base and its LoRA adapter loaded for the backend (``load``), the layers that get
LoRA (``targets``), and the loss from hidden states that never holds the whole logits (``headloss``,
``headchunks``)."""
