"""Model executor: ForwardMode/ForwardBatch, ModelRunner, CudaGraphRunner."""
