"""growtrain: grow a residual network one function-preserving block at a time, until saturated."""

from growtrain.growable import GrowableStack, Site, find_growable, grown_blocks, replay_growth

__all__ = ["Site", "GrowableStack", "find_growable", "grown_blocks", "replay_growth"]
__version__ = "0.1.0"
