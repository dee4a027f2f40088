"""The cluster target: many SGLang workers behind one front (``omni``), and what starts them."""
