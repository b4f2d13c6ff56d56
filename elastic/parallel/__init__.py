"""Layout planning: valid layouts, memory per GPU, stage partition, throughput. Pure code."""
