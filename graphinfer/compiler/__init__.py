"""The compiler: trace (model -> fx graph), passes (graphinfer/passes), artifacts (save / load a compiled graph)."""
