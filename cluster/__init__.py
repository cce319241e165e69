"""pagedserve.cluster"""
