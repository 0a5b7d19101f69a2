//! A model swap (`PUT /v1/model`, a publish beside training): the new model's tables are
//! computed by the partitions beside the live ones, one layer per round, then installed
//! between two rounds ([`SwapInFlight`]).
use super::*;

/// A new model whose tables the partitions are computing, one layer per round.
pub(super) struct SwapInFlight {
    model: Arc<ModelValues>,
    version: String,
    seq: u32,
    /// The next layer to compute.
    next: usize,
    /// Its last layer's rows (the logits, or `Z` with a last-layer bias), gathered from the
    /// partitions.
    logits: Rows,
    /// Its last-layer bias, as [`Engine::last_bias`].
    last_bias: Option<Vec<f32>>,
    /// Nodes changed since the pass started (replayed onto the new tables at the end).
    changed: Vec<u32>,
    reply: Reply,
    /// The span of the request that asked for it.
    trace: Option<TraceContext>,
}

impl Engine {
    pub(super) async fn begin_swap(
        &mut self,
        saved: SavedModel,
        reply: Reply,
        trace: Option<TraceContext>,
    ) {
        if self.swap.is_some() {
            let _ = reply.send(Err(ServeError::Conflict(
                "another model is being loaded; retry when it is served".into(),
            )));
            return;
        }
        let current = self
            .store
            .model
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .config
            .clone();
        if !saved.meta.config.same_architecture(&current) {
            let _ = reply.send(Err(ServeError::BadRequest(format!(
                "the new model ({} {}->{}->{}, {} layers) is not the architecture being served",
                saved.meta.config.kind,
                saved.meta.config.in_dim,
                saved.meta.config.hidden,
                saved.meta.config.out_dim,
                saved.meta.config.layers
            ))));
            return;
        }
        let version = saved.version();
        let last_bias = match last_bias(&saved.model) {
            Ok(b) => b,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        let model = match ModelValues::of(&saved.model, saved.meta.normalize_features) {
            Ok(m) => Arc::new(m),
            Err(e) => {
                let _ = reply.send(Err(e.into()));
                return;
            }
        };
        if let Err(e) = self.stage_everywhere(&model).await {
            let _ = reply.send(Err(e));
            return;
        }
        let seq = self.next_seq();
        self.swap = Some(SwapInFlight {
            model,
            version,
            seq,
            next: 0,
            logits: Rows::zeros(self.nodes(), self.classes),
            last_bias,
            changed: Vec::new(),
            reply,
            trace,
        });
    }

    /// Computes the next layer of the new model's tables; after the last, replays the
    /// changes made meanwhile onto them and installs them.
    pub(super) async fn swap_step(&mut self) {
        let Some(mut s) = self.swap.take() else {
            return;
        };
        let layers = self.split.len();
        let span = tracing::info_span!(
            "serve_swap_layer",
            layer = s.next as i64,
            version = %s.version
        );
        crate::telemetry::join_requests(&span, [s.trace]);
        let _span = span.entered();
        if s.next < layers {
            let plan = self.plan(Coverage::Full).swap_remove(s.next);
            let all = vec![true; self.parts];
            match self
                .run_pass(s.seq, &[plan], Target::Staged, None, &all)
                .await
            {
                Ok(out) => {
                    for r in &out.last {
                        s.logits.grow(self.nodes());
                        s.logits.scatter(&r.ids, &r.data);
                    }
                    s.next += 1;
                    self.swap = Some(s);
                }
                Err(PassError::Failed(parts)) => {
                    self.swap = Some(s);
                    if let Err(e) = self.recover(parts).await {
                        tracing::error!("serving: {e}");
                        if let Some(s) = self.swap.take() {
                            let _ = s.reply.send(Err(e));
                        }
                    }
                }
                Err(PassError::Other(e)) => {
                    self.drop_staged();
                    let _ = s.reply.send(Err(e));
                }
            }
            return;
        }
        // Replay the changes made while the layers were computed, then install.
        let result = self.finish_swap(&mut s).await;
        match result {
            Ok(()) => {
                self.version = s.version.clone();
                *self.store.model.write().unwrap_or_else(|e| e.into_inner()) = s.model.clone();
                *self.stats.version.lock().expect("stats lock") = self.version.clone();
                let n = self.nodes();
                self.last_bias = s.last_bias.clone();
                let rows = last_rows(s.logits, self.last_bias.as_ref());
                let edits = std::mem::take(&mut self.unpublished);
                self.published.replace(self.version.clone(), rows, &edits);
                self.increments.clear();
                let _ = s.reply.send(Ok(Answer {
                    model_version: self.version.clone(),
                    predictions: Vec::new(),
                    recomputed_rows: vec![n; layers],
                    edges_added: None,
                    edges_removed: None,
                }));
            }
            Err(PassError::Failed(parts)) => {
                self.swap = Some(s);
                if let Err(e) = self.recover(parts).await {
                    if let Some(s) = self.swap.take() {
                        let _ = s.reply.send(Err(e));
                    }
                }
            }
            Err(PassError::Other(e)) => {
                // Some partitions may have installed the new tables and others not: the
                // old model (still the store's) is computed again everywhere.
                let _ = s.reply.send(Err(e.clone()));
                let _ = self
                    .rebuild_or_break(format!("installing model {} failed: {e}", s.version))
                    .await;
            }
        }
    }

    pub(super) async fn finish_swap(&mut self, s: &mut SwapInFlight) -> Result<(), PassError> {
        if !s.changed.is_empty() {
            let full = vec![false; self.parts];
            let plans = self.plan(Coverage::Changed {
                nodes: &s.changed,
                full: &full,
            });
            let seq = self.next_seq();
            let out = self
                .run_pass(seq, &plans, Target::Staged, None, &full)
                .await?;
            s.logits.grow(self.nodes());
            for r in &out.last {
                s.logits.scatter(&r.ids, &r.data);
            }
        }
        for a in self.handles()? {
            let p = a.part();
            let installed = a.install().await.map_err(actor_err)?;
            if !installed {
                return Err(PassError::Other(ServeError::Internal(format!(
                    "serving partition {p} had no new tables to install"
                ))));
            }
        }
        Ok(())
    }

    /// After a recovery: a swap in flight starts again from its first layer (the restarted
    /// partitions lost its tables).
    pub(super) async fn restart_swap(&mut self) {
        let Some(mut s) = self.swap.take() else {
            return;
        };
        match self.stage_everywhere(&s.model).await {
            Ok(()) => {
                s.seq = self.next_seq();
                s.next = 0;
                s.changed.clear();
                s.logits = Rows::zeros(self.nodes(), self.classes);
                self.swap = Some(s);
            }
            Err(e) => {
                let _ = s.reply.send(Err(e));
            }
        }
    }

    /// Nodes an update changed while a swap is in flight are replayed onto its tables.
    pub(super) fn note_changed(&mut self, changed: &[u32]) {
        if let Some(s) = &mut self.swap {
            s.changed.extend_from_slice(changed);
        }
    }

    pub(super) fn drop_staged(&self) {
        if let Ok(handles) = self.handles() {
            for h in handles {
                h.drop_staged();
            }
        }
    }
}
