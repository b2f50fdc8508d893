"""tf.Graph -> LayerGraph: the analyser, layers, graph utilities.

Also MetaGraph loading and pictures."""
