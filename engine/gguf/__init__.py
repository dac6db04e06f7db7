"""GGUF in one package: reading a file (tensors: the tensor table; convert: the one-time
conversion to a Hugging Face folder, and the float tensors left in the file), where a model's
file is (source), and its blocks' layouts (blocks: the linear layers' rows as the file stores
them; w4: Q4_0/Q4_1 blocks repacked into w4 tiles). The models' loader and the gguf linear
method (engine.layers.quantization.gguf) build on it; it imports neither."""
