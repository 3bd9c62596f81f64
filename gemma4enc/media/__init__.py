"""Files to pixels to patches: the walk and kind sniffing, decoding (images, sampled video frames),
Gemma 4's resize and 16x16 patches, and the worker processes that do both. No torch here."""
