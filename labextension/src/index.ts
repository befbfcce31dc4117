/**
 * The jupyter_shard JupyterLab extension: a "Distributed" side panel and a status-bar item for the
 * current notebook's rank pool (through the kernel's `jupyter_shard` comm), and the handler that
 * turns the strategy picker's "Insert as new cell" message into a cell below the active one.
 */
import { ILabShell, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { INotebookTracker, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { KernelMessage } from '@jupyterlab/services';
import { IRenderMimeRegistry } from '@jupyterlab/rendermime';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';
import { Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { ShardClient } from './client';
import { insertCellCode, statusBarText } from './format';
import { figureRenderer } from './figure';
import { DistributedPanel, POLL_MS } from './panel';
import { rankOutputRenderer } from './renderer';

const ICON_SVG =
  '<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 16 16">' +
  '<g class="jp-icon3" fill="#616161"><rect x="1" y="2" width="6" height="5" rx="1"/>' +
  '<rect x="9" y="2" width="6" height="5" rx="1"/><rect x="1" y="9" width="6" height="5" rx="1"/>' +
  '<rect x="9" y="9" width="6" height="5" rx="1"/></g></svg>';

const shardIcon = new LabIcon({ name: 'jupyter_shard:ranks', svgstr: ICON_SVG });

/** Insert `code` as a new code cell below the notebook's active cell. */
export function insertCell(panel: NotebookPanel, code: string): void {
  const notebook = panel.content;
  NotebookActions.insertBelow(notebook);
  const cell = notebook.activeCell;
  if (cell) {
    cell.model.sharedModel.setSource(code);
  }
}

function watchPicker(panel: NotebookPanel): void {
  panel.sessionContext.iopubMessage.connect((_, msg: KernelMessage.IMessage) => {
    if (msg.header.msg_type !== 'comm_msg') {
      return;
    }
    const code = insertCellCode((msg as KernelMessage.ICommMsgMsg).content.data);
    if (code !== null) {
      insertCell(panel, code);
    }
  });
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyter_shard:plugin',
  description: 'Side panel and status bar for jupyter_shard rank pools',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ILabShell, IStatusBar, IRenderMimeRegistry],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    labShell: ILabShell | null,
    statusBar: IStatusBar | null,
    rendermime: IRenderMimeRegistry | null
  ) => {
    // Notebook outputs render through this registry: add the rank-output renderer to it.
    rendermime?.addFactory(rankOutputRenderer);
    // The dashboard's live Plotly figure, redrawn in place (ahead of Plotly's renderer, rank 2).
    rendermime?.addFactory(figureRenderer, figureRenderer.defaultRank);
    const clients = new Map<NotebookPanel, ShardClient>();
    const lastRefresh = new Map<ShardClient, number>();
    // The tracker may announce a notebook as current before it reports it added: create on demand.
    const clientFor = (panel: NotebookPanel): ShardClient => {
      let client = clients.get(panel);
      if (client) {
        return client;
      }
      const created = new ShardClient(panel.sessionContext);
      client = created;
      clients.set(panel, created);
      lastRefresh.set(created, 0);
      watchPicker(panel);
      // After a cell finishes, refresh once so the status bar follows without the panel open.
      panel.sessionContext.statusChanged.connect((_, status) => {
        if (status === 'idle' && Date.now() - (lastRefresh.get(created) ?? 0) > POLL_MS) {
          lastRefresh.set(created, Date.now());
          created.request('status');
        }
      });
      panel.disposed.connect(() => {
        clients.delete(panel);
        lastRefresh.delete(created);
        created.dispose();
      });
      return created;
    };
    tracker.widgetAdded.connect((_, panel) => void clientFor(panel));

    const sidePanel = new DistributedPanel();
    sidePanel.title.icon = shardIcon;
    app.shell.add(sidePanel, 'right', { rank: 900 });

    const item = new Widget();
    item.addClass('jp-ShardStatus');
    let followed: ShardClient | null = null;
    const itemActive = new Signal<Widget, void>(item);
    const renderItem = () => {
      itemActive.emit();
      item.node.textContent = followed ? statusBarText(followed.status, followed.kernelBusy) : '';
      item.node.title = 'jupyter_shard rank pool: click for the Distributed panel';
    };
    item.node.onclick = () => app.shell.activateById(sidePanel.id);

    const follow = () => {
      const panel = tracker.currentWidget;
      const client = panel ? clientFor(panel) : null;
      followed?.changed.disconnect(renderItem);
      followed = client;
      client?.changed.connect(renderItem);
      sidePanel.client = client;
      renderItem();
    };
    tracker.currentChanged.connect(follow);
    follow();

    if (statusBar) {
      statusBar.registerStatusItem('jupyter_shard:status', {
        item,
        align: 'left',
        rank: 4,
        isActive: () => !!followed?.status?.pool,
        activeStateChanged: itemActive
      });
    }
    void labShell;
  }
};

export default plugin;
