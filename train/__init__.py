"""ugro: the training package every rank runs, and the controller CLI that launches it."""
