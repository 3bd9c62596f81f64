"""The Gemma 4 vision tower: finding a checkpoint (a folder or the hub), what its layouts hold,
the tower in plain torch, the batching plans and loading the towers a run asks for."""
