"""Front end: read a Hugging Face checkpoint (architecture table, lazy safetensors, rope), build and trace a stage."""
