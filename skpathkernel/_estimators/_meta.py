"""What the meta-estimators share: a network trainer passed as ``estimator=``.

:class:`~skpathkernel.TangentFeatures`, :class:`~skpathkernel.TangentFeatureSVM` and
:class:`~skpathkernel.OODRankDetector` own no training parameter. Each takes a trainer,
:class:`~skpathkernel.PathKernelMachine` or :class:`~skpathkernel.PathKernelClassifier`,
as scikit-learn's meta-estimators take theirs (``SelectFromModel``,
``CalibratedClassifierCV``): ``fit`` clones and fits it (``estimator_``), and the
meta-estimator reads the network it trained (``estimator_.network_``). A trainer wrapped
in :class:`sklearn.frozen.FrozenEstimator` is used as it is, never refitted; a search
reaches the network's parameters as ``estimator__hidden_layer_sizes``. A network trained
in a user's own loop, :class:`~skpathkernel.RecordedNetwork`
(``PathRecorder.as_estimator``), is fitted by construction and its ``fit`` does nothing:
it is used as it is, bare or in a ``FrozenEstimator``, as a frozen trainer is.

The trainer may end a :class:`~sklearn.pipeline.Pipeline` (or be a refitted search's
``best_estimator_``), which :func:`~skpathkernel._network._trained.pipeline_last_step`
follows for the kernels: the network takes ``X`` as the steps before it hand it over.
A fitted one in a ``FrozenEstimator`` is used as it is; an unfrozen pipeline is cloned,
its steps fitted on ``X``, then the trainer on their output, as the trainer alone is.

With ``sklearn.set_config(enable_metadata_routing=True)`` they route ``sample_weight`` as
scikit-learn's meta-estimators do (``CalibratedClassifierCV``, ``MultiOutputRegressor``):
the trainer's ``fit`` receives it only where the trainer requested it
(``PathKernelClassifier().set_fit_request(sample_weight=True)``), and a weight passed to
a trainer that said nothing is an error naming it; a trainer that requested it under an
alias (``set_fit_request(sample_weight="w")``) receives ``fit(X, y, w=...)``'s, as
their ``**fit_params`` route it. An unfrozen pipeline given as the trainer routes on
to its own steps, each taking what it requested (a scaler's weight), as ``Pipeline.fit``
does. Without routing, ``fit`` passes it to the trainer as before (not to a pipeline's
other steps), and refuses any other keyword as ``BaggingRegressor`` does.
"""

from __future__ import annotations

import math

import numpy as np
from sklearn.base import BaseEstimator, MetaEstimatorMixin, clone
from sklearn.frozen import FrozenEstimator
from sklearn.model_selection._search import BaseSearchCV
from sklearn.pipeline import Pipeline
from sklearn.utils._param_validation import HasMethods
from sklearn.utils.metadata_routing import (
    MetadataRouter,
    MethodMapping,
    _raise_for_params,
    _routing_enabled,
    process_routing,
)
from sklearn.utils.multiclass import type_of_target
from sklearn.utils.validation import (
    _check_feature_names,
    _check_n_features,
    _check_y,
    check_consistent_length,
    check_is_fitted,
)

from .._network._inputs import (
    FEATURES,
    TOKENS,
    check_ids,
    check_representable,
    validate_input,
)
from .._network._trained import (
    TrainedNetwork,
    _followed,
    _wrapped_network_hint,
    network_of,
    pipeline_last_step,
)
from .._path._recorder import PathRecorder, RecordedNetwork
from .._validation import check_column_names
from .._warnings import VersionedStateMixin
from ..kernels import NetworkKernelsMixin
from ._base import (
    FIT_CHECKS,
    FittedAttribute,
    FittedNetworkMixin,
    _check_weights,
    reject_sparse_y,
)
from ._machine import PathKernelClassifier, PathKernelMachine

__all__ = ["NetworkMetaEstimator", "trained_task", "trainer_for"]

_CLASS_TARGETS = ("binary", "multiclass", "multilabel-indicator")

ESTIMATOR_DOC = """
    estimator : PathKernelMachine, PathKernelClassifier or RecordedNetwork, default=None
        The network trainer, which owns every training parameter (architecture or
        ``module``, solver, epochs, ``dtype``, ``memory_budget``, storage of the path).
        ``fit`` fits a clone of it (``estimator_``); set its parameters through this
        estimator as ``estimator__<name>``, e.g. in ``GridSearchCV``. A fitted trainer
        wrapped in :class:`sklearn.frozen.FrozenEstimator` is used as it is: ``fit``
        trains nothing, and reads its network on the ``X`` it is given. So is a
        :class:`~skpathkernel.RecordedNetwork` (a network trained in your own loop,
        ``PathRecorder.as_estimator``), bare or in a ``FrozenEstimator``: it is fitted
        by construction, and its ``fit`` does nothing. ``clone`` deep-copies a bare one
        (module and trajectory) and returns a ``FrozenEstimator`` as it is: wrap a large
        network for a search or a cross-validation, which clone it per fit.
        The trainer may be the last step of a :class:`~sklearn.pipeline.Pipeline`: every
        method then takes ``X`` as the pipeline does, the network the output of the
        steps before it. ``fit`` clones an unfrozen pipeline and fits its steps on
        ``X``, ``y`` (without ``sample_weight``, which the trainer alone receives), then
        the trainer on their output; a fitted one in a ``FrozenEstimator`` is used as it
        is, and so is a fitted ``GridSearchCV`` or ``RandomizedSearchCV`` (its
        ``best_estimator_``, a pipeline or a trainer) there. A fitted search, a
        ``FrozenEstimator`` or a ``RecordedNetwork`` inside an unfrozen pipeline is
        refused: freeze the whole."""

FITTED_DOC = """
    estimator_ : PathKernelMachine, PathKernelClassifier, RecordedNetwork, Pipeline or search
        The fitted trainer: a clone of ``estimator`` (or the default one) fitted here, or
        the trainer inside a ``FrozenEstimator`` (or a bare ``RecordedNetwork``), itself.
        With a pipeline or a search, the fitted pipeline or search (the one given in a
        ``FrozenEstimator``, or the clone fitted here), whose last step (or
        ``best_estimator_``) is the trainer whose network is read.
        One fitted here on a DataFrame has its column names (``feature_names_in_``), as
        the inner estimators of :class:`sklearn.multioutput.MultiOutputRegressor` have.
    network_ : TrainedNetwork
        ``estimator_``'s network (its last step's) and its recorded path, which the
        kernels (``tangent_kernel_``, ``path_kernel_``) and the displays read. ``module_``,
        ``trajectory_``, ``n_params_``, ``n_outputs_``, ``device_``, ``dtype_``,
        ``loss_curve_``, ``best_loss_``, ``validation_scores_``,
        ``best_validation_score_``, ``n_iter_`` and ``t_`` are ``estimator_``'s, read
        from it. A ``RecordedNetwork`` has the network's own (``module_`` to
        ``dtype_``; ``n_outputs_`` counted by ``fit`` on one sample), and none of the
        training loop's (``loss_curve_`` to ``t_``: an ``AttributeError``, as
        scikit-learn's for a fitted attribute an estimator does not have).
    X_fit_ : ndarray of shape (n_samples_fit, n_features) or (n_samples_fit, ...)
        The training points of the kernel rows: the samples ``estimator_`` trained on
        (all of ``X`` unless ``early_stopping`` held some out), or with a
        ``FrozenEstimator`` (or a ``RecordedNetwork``) the ``X`` given to ``fit``; as the
        network takes them (with a pipeline, the output of the steps before the trainer).
    train_indices_ : ndarray of int of shape (n_samples_fit,)
        The rows of the ``X`` given to ``fit`` that ``X_fit_`` holds, in its order:
        ``X_fit_`` equals ``X[train_indices_]`` (``X`` after this estimator's input
        conversion; ``X.iloc[train_indices_]`` for a DataFrame). Every training-point
        output (a kernel's training columns, ``kneighbors``' indices) indexes ``X_fit_``;
        this maps it back to ``X``. ``estimator_``'s own when it was fitted here
        (``arange(n_samples)`` unless ``early_stopping`` held rows out); with a
        ``FrozenEstimator`` (or a ``RecordedNetwork``), ``arange(n_samples)``: ``X_fit_``
        is this ``X``, while the frozen trainer's ``train_indices_`` index the ``X`` of
        its own earlier fit. An ``OODRankDetector``'s ``X_fit_`` (and so these indices)
        also leaves out the rows of ``sample_weight`` 0 and repeated rows (it keeps the
        first occurrence).
    n_features_in_ : int
        Number of features seen during fit (values per sample for ``(n, ...)`` inputs;
        with a pipeline, of the ``X`` given to it).
    input_shape_ : tuple of int
        Trailing shape of ``X`` at fit; every method that takes ``X`` expects it.
    feature_names_in_ : ndarray of shape (`n_features_in_`,)
        Names of features seen during fit, when X has string column names.
"""


def trained_task(estimator) -> str:
    """"classification" for a network trained on class labels, else "regression".

    A :class:`PathKernelClassifier`, or a :class:`RecordedNetwork` whose declared loss is
    "log_loss" (an own loop declares what it minimized, not what its targets were).
    """
    if isinstance(estimator, RecordedNetwork):
        loss = estimator.network_.loss
        return "classification" if loss is not None and loss.name == "log_loss" \
            else "regression"
    return "classification" if isinstance(estimator, PathKernelClassifier) else "regression"


def trainer_for(y, random_state):
    """The default trainer for targets ``y``, as scikit-learn chooses a stratified split.

    :func:`~sklearn.utils.multiclass.type_of_target` "binary" or "multiclass" (labels,
    and integer-valued targets with few distinct values) is class labels, and
    "multilabel-indicator" (0/1 columns) label sets, as ``MLPClassifier`` trains them: a
    :class:`PathKernelClassifier`; anything else (continuous, multi-output) a
    :class:`PathKernelMachine`.
    """
    kind = type_of_target(y, input_name="y", raise_unknown=True)
    cls = PathKernelClassifier if kind in _CLASS_TARGETS else PathKernelMachine
    return cls(random_state=random_state)


class NetworkMetaEstimator(FittedNetworkMixin, NetworkKernelsMixin, MetaEstimatorMixin,
                           VersionedStateMixin, BaseEstimator):
    """Base of the meta-estimators: fit a trainer, read its network.

    Subclasses say which trainers they take (``_trainers``) and how the default one is
    chosen (``_default_trainer``). A :class:`RecordedNetwork` among them is frozen by
    construction: used as it is, never cloned nor fitted.
    """

    _parameter_constraints: dict = {
        "estimator": [HasMethods(["fit"]), None],
        "random_state": ["random_state"],
    }
    _trainers: tuple = (PathKernelMachine, PathKernelClassifier, RecordedNetwork)
    # Whether fit uses sample_weight itself (the SVM's weights, the detector's span) as well
    # as routing it to the trainer: its own request then joins the router (as
    # CalibratedClassifierCV's), where a pure router's (MultiOutputRegressor's) does not.
    _uses_sample_weight: bool = True
    # The trainer named in routing errors when estimator=None: fit makes the default one
    # from y, which get_metadata_routing does not have (both trainers take sample_weight
    # alike, with no request set).
    _routing_default: type = PathKernelMachine

    # Read from the fitted trainer (estimator_, or the last step of the pipeline it is):
    # one source of truth.
    module_ = FittedAttribute("_network_estimator", label="estimator_")
    trajectory_ = FittedAttribute("_network_estimator", label="estimator_")
    device_ = FittedAttribute("_network_estimator", label="estimator_")
    dtype_ = FittedAttribute("_network_estimator", label="estimator_")
    n_params_ = FittedAttribute("_network_estimator", label="estimator_")
    loss_curve_ = FittedAttribute("_network_estimator", label="estimator_")
    best_loss_ = FittedAttribute("_network_estimator", label="estimator_")
    validation_scores_ = FittedAttribute("_network_estimator", label="estimator_")
    best_validation_score_ = FittedAttribute("_network_estimator", label="estimator_")
    n_iter_ = FittedAttribute("_network_estimator", label="estimator_")
    t_ = FittedAttribute("_network_estimator", label="estimator_")
    # The meta-estimator's own: the points its kernel rows and spans are against.
    X_fit_ = FittedAttribute()
    train_indices_ = FittedAttribute()

    @property
    def n_outputs_(self):
        """Outputs of the network: ``estimator_``'s, or counted by ``fit`` for a
        :class:`RecordedNetwork` (an own loop declares none)."""
        counted = self.__dict__.get("_n_outputs")
        if counted is not None:
            return counted
        if "estimator_" not in self.__dict__:
            # Named as the other fitted attributes are (a descriptor under a private name
            # said "no attribute '_n_outputs_of_trainer'").
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute 'n_outputs_' (not fitted)")
        return self._network_estimator.n_outputs_

    @property
    def network_(self):
        """The fitted trainer's network (see :class:`~skpathkernel.TrainedNetwork`)."""
        if "estimator_" not in self.__dict__:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute 'network_' (not fitted)")
        return network_of(self._network_estimator)

    def _network_wrapper(self):
        """The fitted pipeline or search that ``estimator_`` is, whose last step (or
        ``best_estimator_``) holds the network; None where ``estimator_`` holds it, or
        before fit. :func:`~skpathkernel._network._trained.pipeline_last_step` follows
        this estimator into it, so that the kernels, the displays and the diagnostics
        take ``X`` as this estimator does."""
        est = self.__dict__.get("estimator_")
        return None if est is None or hasattr(est, "network_") else est

    @property
    def _network_estimator(self):
        """The fitted estimator holding the network: ``estimator_``, or the one inside
        the pipeline or search it is."""
        wrapper = self._network_wrapper()
        return self.estimator_ if wrapper is None else pipeline_last_step(wrapper)[0]

    def _trained_by(self):
        return self._network_estimator

    def _neighbour_network(self):
        # kneighbors' indices index X_fit_, which the trainer's network need not hold: a
        # frozen trainer's is the X of its own earlier fit (not this fit's X), and the
        # detector keeps only the rows of positive weight. Searched there, indices past
        # len(X_fit_) or of other rows came back without a word.
        return network_of(self).replace(X_fit=self.X_fit_, y_fit=None, sample_weight=None,
                                        _unread_fit=None)

    # ------------------------------------------------------------------ the trainer
    def _trainer(self):
        """``(trainer or None, frozen)``: the ``estimator`` parameter, unwrapped.

        The trainer is the estimator itself, or the one holding the network inside the
        pipeline or the refitted search it is (:func:`pipeline_last_step`'s way: a
        pipeline's last step, a ``best_estimator_``, a ``FrozenEstimator``'s estimator).
        A :class:`RecordedNetwork` is frozen, wrapped or not: cloned and fitted it would
        be a deep copy of the same network (its ``fit`` does nothing), and ``fit``'s
        ``X`` is the only training input it has for sure (``X_train`` is optional).
        """
        return self._resolved()[1:]

    def _resolved(self):
        """``(estimator out of a FrozenEstimator, trainer, frozen)``; see :meth:`_trainer`."""
        est = self.estimator
        frozen = isinstance(est, FrozenEstimator)
        inner = est.estimator if frozen else est
        # A class is refused below as one: its methods are not bound.
        chain = [inner] if inner is None or isinstance(inner, type) else _followed(inner)
        self._check_trainer_type(inner, chain[-1])
        if len(chain) > 1 and not frozen and (
                not all(isinstance(step, Pipeline) for step in chain[:-1])
                or isinstance(chain[-1], RecordedNetwork)):
            # fit clones an unfrozen estimator and fits it: a pipeline's steps are, but
            # a search would search again, and a FrozenEstimator or a RecordedNetwork
            # inside would keep a network trained on the inputs of steps now refitted.
            raise TypeError(
                f"{type(self).__name__} clones and fits an estimator that is not frozen; "
                f"the {type(inner).__name__} given holds a fitted network (a search's "
                "best_estimator_, a FrozenEstimator or a RecordedNetwork inside) that "
                f"this fit would not use as it is. Wrap the fitted "
                f"{type(inner).__name__} in sklearn.frozen.FrozenEstimator to read its "
                "network as it is, or pass an unfitted Pipeline ending in a trainer to "
                "fit it here.")
        trainer = chain[-1]
        return inner, trainer, frozen or isinstance(trainer, RecordedNetwork)

    def _check_trainer_type(self, outer, inner) -> None:
        """Refuse a ``estimator`` whose trainer ``inner`` (``outer`` itself, or the last
        step of the pipeline or search ``outer`` is) is not one this estimator takes."""
        if inner is not None and not isinstance(inner, self._trainers):
            trainers = [cls.__name__ for cls in self._trainers if cls is not RecordedNetwork]
            recorded = RecordedNetwork in self._trainers
            # A class (estimator=PathKernelClassifier, the call forgotten) is named as
            # one: its type is the metaclass, and "got ABCMeta" said nothing.
            got = (f"the class {inner.__name__}, not an instance: pass "
                   f"{inner.__name__}(...)" if isinstance(inner, type)
                   else type(inner).__name__)
            if outer is not inner:
                got = f"{type(outer).__name__} holding {got}"
            # Where the network is in a fitted wrapper that none of the trainers is (a
            # bag, a search without refit), as the kernels' refusal says it.
            hint = "" if isinstance(outer, type) else _wrapped_network_hint(outer)
            if hint:
                got += hint
            elif isinstance(outer, BaseSearchCV) and not hasattr(outer, "cv_results_"):
                got += (": a search fits its candidates itself; fit it, and pass it in "
                        "sklearn.frozen.FrozenEstimator to read its best_estimator_'s "
                        "network as it is")
            # The recorder and its as_network are what an own loop has at hand: the
            # estimator that takes their place is named.
            if recorded and isinstance(inner, PathRecorder):
                got += ": pass recorder.as_estimator(X_train, y_train, loss=...)"
            elif recorded and isinstance(inner, TrainedNetwork):
                got += (": pass the estimator whose network_ it is, in a FrozenEstimator, "
                        "or recorder.as_estimator(...) in place of as_network")
            raise TypeError(
                f"{type(self).__name__} takes a skpathkernel trainer as estimator, a "
                f"{' or '.join(trainers)} (fitted and wrapped in "
                f"sklearn.frozen.FrozenEstimator to use its network as it is)"
                + (", or a RecordedNetwork (PathRecorder.as_estimator: a network trained "
                   "in your own loop, used as it is)" if recorded else "")
                + ", or a Pipeline ending in one (cloned and fitted, or fitted and "
                "frozen), or a search refitted on one, fitted and frozen"
                + f"; got {got}"
                + ("" if got.endswith(".") else ".")
            )

    def _validate_params(self):
        # scikit-learn's "must be an object implementing 'fit'" would refuse a PathRecorder
        # or a TrainedNetwork without naming as_estimator, which gives what is taken.
        if isinstance(self.estimator, (PathRecorder, TrainedNetwork)):
            self._trainer()
        super()._validate_params()

    def _is_frozen(self) -> bool:
        """Whether ``fit`` will use the trainer as it is (tags read it before fit)."""
        try:
            return self._trainer()[1]
        except TypeError:  # a wrong estimator: fit says so
            return False

    def _default_trainer(self, y):
        return trainer_for(y, self.random_state)

    def set_params(self, **params):
        """Set the parameters of this estimator and, as ``estimator__<name>``, its trainer's.

        With ``estimator=None`` there is no trainer to set them on until ``fit`` makes
        the default one; pass the trainer (``estimator=PathKernelClassifier()``) to tune
        its parameters, in the same call or before.

        Parameters
        ----------
        **params : dict
            Estimator parameters.

        Returns
        -------
        self : estimator instance
            Estimator instance.
        """
        nested = sorted(key for key in params if key.startswith("estimator__"))
        if nested and params.get("estimator", self.estimator) is None:
            kinds = " or ".join(f"{cls.__name__}()" for cls in self._trainers)
            raise ValueError(
                f"Cannot set {', '.join(nested)}: {type(self).__name__} has estimator=None, "
                f"and its default trainer is made by fit. To tune the trainer's "
                f"parameters, pass it as estimator= ({kinds}), in the same set_params "
                f"call or before (in GridSearchCV: {type(self).__name__}(estimator=...)).")
        return super().set_params(**params)

    def get_metadata_routing(self):
        """Get metadata routing of this object.

        ``fit`` routes ``sample_weight`` to the trainer's ``fit`` where the trainer
        requested it (``set_fit_request``); a ``FrozenEstimator`` is not fitted, and
        receives nothing. Please check :ref:`User Guide <metadata_routing>` on how the
        routing mechanism works.

        Returns
        -------
        routing : MetadataRouter
            A :class:`~sklearn.utils.metadata_routing.MetadataRouter` encapsulating
            routing information.
        """
        router = MetadataRouter(owner=self)
        if self._uses_sample_weight:
            router.add_self_request(self)
        # The estimator as given: a pipeline routes on to its own steps, as it does
        # under scikit-learn's meta-estimators (a scaler's requested weight reaches it).
        outer, inner, frozen = self._resolved()
        if not frozen:
            router.add(estimator=self._routing_default() if inner is None else outer,
                       method_mapping=MethodMapping().add(caller="fit", callee="fit"))
        return router

    def _check_targets(self, y) -> None:
        """Refuse targets before any training (the trainer checks them otherwise)."""

    def _check_weighted(self, X, y, sample_weight) -> None:
        """Refuse, before any training, validated data and weights that this estimator's
        own part of ``fit`` (not the trainer's) would refuse after it."""

    def _check_trainer(self, trainer, y, sample_weight) -> None:
        """Refuse, before it trains, a trainer (the clone about to be fitted on the
        validated ``y``) whose fit would leave this estimator's own part of ``fit`` (with
        its validated ``sample_weight``, whether or not the trainer gets them) nothing it
        can use."""

    def _y_required(self, frozen: bool) -> bool:
        """Whether ``fit`` needs ``y``, given whether the trainer is frozen."""
        return self.__sklearn_tags__().target_tags.required

    def _fit_trainer(self, X, y, *, target=None, sample_weight=None, fit_params=None):
        """Validate ``X`` (and ``y``) here, then fit a clone of the trainer on them.

        ``target``: what the trainer is fitted on instead of ``y`` (the detector's
        reconstruction). ``sample_weight``: validated before any training (scikit-learn's
        checks) and passed to the trainer's fit (a frozen trainer is not trained); with
        metadata routing enabled, the trainer gets the weight routed to it instead: this
        one where it requested ``sample_weight=True``, another of ``fit_params`` under the
        alias it requested (``set_fit_request(sample_weight="w")``), none where it
        declined. ``fit_params`` without routing are refused, as by scikit-learn's
        ``BaggingRegressor``. Sets ``estimator_``, ``X_fit_`` and ``train_indices_``
        (their rows in ``X``); returns the validated
        ``(X, y)``, whether the trainer was frozen (then nothing was trained, and ``X``
        was checked against its network) and the validated ``sample_weight`` (None when
        not given or all equal), which the meta-estimator's own use of them reads
        whether or not the trainer got them.
        """
        fit_params = {} if fit_params is None else fit_params
        outer, inner, frozen = self._resolved()
        wrapper = None if outer is inner else outer
        to_trainer, other, routing = sample_weight, {}, _routing_enabled()
        if routing:
            # Before any work: a weight that no one requested is refused, naming whom to
            # ask (the trainer's set_fit_request), as scikit-learn's routers refuse it.
            # sample_weight=None is no metadata (as MultiOutputRegressor drops it): a
            # router that routes it to no one refused a fit without weights.
            given = dict(fit_params) if sample_weight is None else {
                **fit_params, "sample_weight": sample_weight}
            routed = process_routing(self, "fit", **given)
            # Everything routed to the trainer reaches its fit, as MultiOutputRegressor
            # passes it: a subclass's other requested metadata too (it was dropped).
            other = {} if frozen else dict(routed.estimator.fit)
        else:
            _raise_for_params(fit_params, self, "fit")
        if frozen:
            net = network_of(inner)  # NotFittedError for a frozen unfitted trainer
            # Named columns are the frozen trainer's (its pipeline's), in its order: this
            # estimator's own names are reset by this fit, and would let reordered
            # columns through.
            check_column_names(outer, X)
            given = X
            if wrapper is not None:
                # The network takes X as the pipeline's steps before it hand it over.
                X = pipeline_last_step(wrapper, X)[1]
                check_column_names(inner, X)
            X, y = self._validate_like_network(X, y, net, frozen=True)
            if wrapper is not None:
                self._record_given(given)
            self._check_targets(y)
            # The X given here is the span's: the frozen trainer's own train_indices_
            # index the X of its earlier fit.
            self.estimator_, self.X_fit_, self.train_indices_ = outer, X, np.arange(len(X))
            # An own loop declares no number of outputs: one sample's forward pass counts
            # them (a trainer's n_outputs_ is read from it).
            self._n_outputs = (net.outputs(X[:1]).shape[1]
                               if isinstance(inner, RecordedNetwork) else None)
            sample_weight = _check_weights(sample_weight, X)
            self._check_weighted(X, y, sample_weight)
            return X, y, True, sample_weight
        given = trainer = None
        if wrapper is not None:
            # Before any step is fitted: what this fit refuses of y and of the rows.
            self._check_given(X, y, sample_weight)
            given, wrapper = X, clone(wrapper)
            # With routing, `other` is what the pipeline gets, in its callers' names:
            # its steps take their part, the trainer what is left for it.
            trainer, X, other = _fit_steps_before_network(
                wrapper, X, y, other if routing else None)
        if routing:  # the weight routed to the trainer, whoever else got one
            to_trainer = other.pop("sample_weight", None)
        # What the trainer is given: X, or what the pipeline's steps made of it.
        to_network = X
        X, y = self._validate_fit_data(X, y, flexible=getattr(inner, "module", None) is not None)
        self._check_targets(y)
        same = to_trainer is sample_weight
        sample_weight = _check_weights(sample_weight, X)
        # An aliased weight is another array than sample_weight: validated alike.
        to_trainer = sample_weight if same else _check_weights(to_trainer, X)
        self._check_weighted(X, y, sample_weight)
        if inner is None:
            trainer = self._default_trainer(y)
        elif trainer is None:  # the pipeline's is its clone already
            trainer = clone(inner)
        self._check_trainer(trainer, y, sample_weight)
        # Weights only when there are some: a trainer subclass whose fit(X, y) takes none
        # keeps working unweighted (equal weights are None here, the unweighted fit).
        weighted = {} if to_trainer is None else {"sample_weight": to_trainer}
        trainer.fit(X, y if target is None else target(X), **weighted, **other)
        # The trainer saw this fit's columns: their names, as those of MultiOutputRegressor's
        # or TransformedTargetRegressor's inner estimators, which are given X as it is.
        # Fitted on the validated array, estimator_ had none, and a kernel over it took
        # reordered columns by position without a word.
        _check_feature_names(trainer, to_network, reset=True)
        if wrapper is not None:
            self._record_given(given)
        self.estimator_ = trainer if wrapper is None else wrapper
        self.X_fit_, self._n_outputs = trainer.X_fit_, None
        self.train_indices_ = trainer.train_indices_
        return X, y, False, sample_weight

    def _check_given(self, X, y, sample_weight) -> None:
        """Refuse, before a pipeline's steps are fitted, the ``y`` and ``sample_weight``
        that the validation of the network's input (after them) would refuse."""
        if y is not None:
            reject_sparse_y(y)
            check_consistent_length(X, y)
            self._check_targets(_check_y(y, multi_output=True))
        if sample_weight is not None:
            check_consistent_length(X, sample_weight)

    def _record_given(self, X) -> None:
        """``n_features_in_``, ``feature_names_in_`` and ``input_shape_`` of the ``X``
        given to ``fit``, where a pipeline's steps transform it for the network: this
        estimator takes that ``X``, as the pipeline does (the network's input form is
        ``network_``'s)."""
        self.__dict__.pop("n_features_in_", None)
        _check_feature_names(self, X, reset=True)
        shape = getattr(X, "shape", None)
        if shape is not None and len(shape) > 2:
            # The values per sample of an (n, ...) input, as validate_input counts them
            # (scikit-learn's count is shape[1], the channels of an image).
            self.n_features_in_ = int(math.prod(shape[1:]))
        else:
            _check_n_features(self, X, reset=True)  # none for inputs without a width
        if shape is not None and len(shape) > 1:
            self.input_shape_ = tuple(int(d) for d in shape[1:])
        elif hasattr(self, "n_features_in_"):
            self.input_shape_ = (self.n_features_in_,)
        else:
            self.__dict__.pop("input_shape_", None)

    def _validate_X(self, X):
        wrapper = self._network_wrapper()
        if wrapper is None:
            return super()._validate_X(X)
        check_is_fitted(self)
        # This estimator's columns and their number, as fit recorded them (a search
        # without steps before the network checks none); the steps check their own. A
        # 1-D X has no number of columns: the steps (or the network) refuse it with
        # scikit-learn's "Reshape your data".
        _check_feature_names(self, X, reset=False)
        shape = getattr(X, "shape", None)
        if shape is None or len(shape) == 2:
            _check_n_features(self, X, reset=False)
        elif len(shape) > 2 and tuple(shape[1:]) != self.input_shape_:
            raise ValueError(
                f"X has shape {tuple(shape)}, but {type(self).__name__} is expecting X of "
                f"shape (n_samples, {', '.join(map(str, self.input_shape_))}), as at fit.")
        holder, X = pipeline_last_step(wrapper, X)
        net = self.network_
        check_column_names(holder, X)
        X = net.check(X)
        check_representable(X, net.torch_dtype)
        return X

    def _validate_fit_data(self, X, y, *, flexible, frozen=False):
        checks = dict(reset=True, flexible=flexible,
                      ensure_min_samples=FIT_CHECKS["ensure_min_samples"])
        if y is None and not self._y_required(frozen):
            return validate_input(self, X, **checks), None
        reject_sparse_y(y)
        return validate_input(self, X, y, multi_output=True, **checks)

    def _validate_like_network(self, X, y, net, frozen=False):
        """``X`` (and ``y``) validated for a fitted network: its input form, its dtype."""
        shape, kind = net.input_shape, net.input_kind
        X, y = self._validate_fit_data(X, y, flexible=kind != FEATURES, frozen=frozen)
        check_representable(X, net.torch_dtype)
        if shape is None:
            # A RecordedNetwork without X_train has no input form of its own: fit's X
            # sets this estimator's, once the module is seen to run it (refused, naming
            # its shape and dtype, where it cannot).
            return net.check(X), y
        if kind == FEATURES and X.shape[1] != net.n_features_in:
            raise ValueError(
                f"X has {X.shape[1]} features, but the estimator's network is expecting "
                f"{net.n_features_in} features as input."
            )
        if (self.input_shape_, self._input_kind) != (shape, kind):
            raise ValueError(
                f"X has shape {X.shape} and dtype {X.dtype}, but the estimator's network "
                f"takes {'integer token ids' if kind == TOKENS else 'float X'} of shape "
                f"(n_samples, {', '.join(map(str, shape))})."
            )
        if kind == TOKENS:
            # As every method after fit checks them: ids beyond the frozen network's
            # embeddings failed inside torch (OODRankDetector, an IndexError) or were kept
            # as the span's points without a word (TangentFeatures).
            check_ids(net.module, X, "X")
        return X, y

    def _trainer_param(self, name, default):
        """A parameter of the trainer that ``fit`` will use (tags read it before fit)."""
        try:
            inner = self._trainer()[0]
        except TypeError:  # a wrong estimator: fit says so
            inner = None
        return default if inner is None else getattr(inner, name, default)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.non_deterministic = False
        tags.input_tags.allow_nan = False
        # With a module, X may be (n, ...): images, sequences, token ids (see _inputs).
        tags.input_tags.three_d_array = self._trainer_param("module", None) is not None
        return tags


def _fit_steps_before_network(pipe, X, y, params=None):
    """Fit the steps of the (cloned) pipeline ``pipe`` before the trainer, as
    ``Pipeline.fit`` does, down the pipelines ending it: ``(trainer, X as it reaches
    the trainer, the metadata routed to the trainer's fit)``. The trainer itself is left
    to the meta-estimator's fit, which checks and weighs its training as it does a
    trainer's given alone.

    ``params``: with metadata routing enabled, what was routed to ``pipe``'s ``fit`` (in
    its callers' names); each level passes its steps before the last what they
    requested and its last step the rest, as ``Pipeline.fit`` routes them. None without
    routing: the steps get nothing, and the trainer nothing from here.
    """
    while isinstance(pipe, Pipeline):
        routed = None if params is None else process_routing(pipe, "fit", **params)
        if len(pipe) > 1:
            head = pipe[:-1]
            # The head's own router picks its steps' requests out of the pipeline's:
            # Pipeline.fit_transform refuses what none of them asked for.
            mine = () if params is None else head.get_metadata_routing().consumes(
                method="fit_transform", params=set(params))
            X = head.fit_transform(X, y, **{key: params[key] for key in mine})
            # With a memory the fitted steps are clones: the pipeline holds them.
            pipe.steps[:-1] = head.steps
        name, pipe = pipe.steps[-1]
        params = None if routed is None else dict(routed[name].fit)
    return pipe, X, {} if params is None else params


def flat_targets(X: np.ndarray) -> np.ndarray:
    """Every value of a sample as a target (its flat view for ``(n, ...)`` inputs); a
    single value 1-D, which the regressor takes without its column-vector warning."""
    T = X.reshape(len(X), -1).astype(np.float64)
    return T[:, 0] if T.shape[1] == 1 else T
