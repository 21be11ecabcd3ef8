"""Kimi K3's vision tower (MoonViT, Kimi K2.5's) and projector; docs/vision.md.

    VisionConfig        config.json's vision_config (+ projector fields), frozen
    VisionEncoder       pixel_values [n_patches, 3, p, p], grid_thws int64 [n_images, 3]
                        -> [sum of image tokens, text hidden], images in order
    num_image_tokens    tokens of an image of grid (t, h, w) after the merge
    preprocess          PIL images -> (pixel_values, grid_thws), as the released processor
    load_image          bytes / local path -> PIL image, with limits; ImageError otherwise
"""

from k3trt.model.vision.encoder import VisionEncoder
from k3trt.model.vision.geometry import GridError, VisionBatch, num_image_tokens, vision_batch
from k3trt.model.vision.image_io import ImageError, load_image
from k3trt.model.vision.preprocess import image_grid, preprocess
from k3trt.vision_config import VisionConfig, VisionConfigError

__all__ = ["GridError", "ImageError", "VisionBatch", "VisionConfig", "VisionConfigError", "VisionEncoder",
           "image_grid", "load_image", "num_image_tokens", "preprocess", "vision_batch"]
