"""pagedserve.kernels"""
