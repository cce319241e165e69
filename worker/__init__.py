"""pagedserve.worker"""
